import uuid

from flask_idempotency.testing import assert_exactly_one


def test_one_order(api, db, downstream):
    key = str(uuid.uuid4())
    assert api.post("/orders", json={"item": "book"}, key=key).status_code == 201
    assert_exactly_one(db, downstream, key)
