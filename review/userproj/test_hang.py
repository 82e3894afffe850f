import time


def test_hangs(api, db):
    time.sleep(120)  # a test that hangs (CI will time it out / cancel it)
