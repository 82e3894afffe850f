"""Packaging for Flask-Idempotency."""

import re
from pathlib import Path

from setuptools import find_packages, setup

# One place for the version: the package's __version__, read without importing it
# (its dependencies are not installed yet).
_INIT = Path(__file__).with_name("flask_idempotency").joinpath("__init__.py")
VERSION = re.search(r'^__version__ = "([^"]+)"', _INIT.read_text(encoding="utf-8"), re.M)
assert VERSION is not None, "flask_idempotency/__init__.py has no __version__"

setup(
    name="Flask-Idempotency",
    version=VERSION.group(1),
    description=(
        "Idempotency-Key support for Flask: retried POSTs run once, "
        "recorded in the same transaction as the business rows."
    ),
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    url="https://github.com/flask-idempotency/flask-idempotency",
    project_urls={
        "Documentation": "https://flask-idempotency.readthedocs.io/",
        "Changelog": "https://flask-idempotency.readthedocs.io/en/latest/changelog.html",
        "Source": "https://github.com/flask-idempotency/flask-idempotency",
        "Issue tracker": "https://github.com/flask-idempotency/flask-idempotency/issues",
    },
    license="MIT",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    packages=find_packages(include=["flask_idempotency", "flask_idempotency.*"]),
    # The testing kit's pytest plugin: a module of its own, which the entry point
    # loads in every pytest run without importing the package.
    py_modules=["flask_idempotency_pytest"],
    package_data={"flask_idempotency": ["py.typed"]},
    include_package_data=True,
    zip_safe=False,
    install_requires=[
        "flask>=3.0",
        "flask-sqlalchemy>=3.1",
        "sqlalchemy>=2.0",
        "marshmallow>=3.18",
        "apscheduler>=3.10,<4",
        # Signs the keys of rendered forms (flask_idempotency.forms); Flask depends on it
        # already, named here because the package imports it itself.
        "itsdangerous>=2.0",
    ],
    extras_require={
        # PostgreSQL through psycopg2: URLs spelled postgresql+psycopg2://...
        "postgresql": ["psycopg2-binary>=2.9"],
        # PostgreSQL through psycopg 3 (SQLAlchemy 2.1's driver for a plain
        # postgresql://): URLs spelled postgresql+psycopg://...
        "psycopg": ["psycopg[binary]>=3.1.8"],
        "mysql": ["pymysql>=1.1"],
        # flask_idempotency.client: retries with one Idempotency-Key for all attempts.
        "client": ["requests>=2.31"],
        # flask_idempotency.publishers.KombuPublisher: the outbox relay to a broker.
        "kombu": ["kombu>=5.3"],
        # OpenTelemetry metrics, spans and trace context (docs/observability.md): the
        # API only; the app's own SDK set-up, if any, decides where they go.
        "otel": ["opentelemetry-api>=1.27"],
        # flask_idempotency.testing's pytest plugin (the kit's fixtures).
        "testing": ["pytest>=8.0"],
        # flask_idempotency.forms.IdempotencyKeyField, for Flask-WTF's FlaskForm.
        "forms": ["flask-wtf>=1.2"],
        # flask_idempotency.openapi.IdempotencyPlugin: the protected operations in the
        # app's OpenAPI document (flask-smorest, APIFlask, apispec's FlaskPlugin).
        "openapi": ["apispec>=6.0"],
        # Encryption at rest (docs/encryption.md): AES-256-GCM over stored answers,
        # kept requests, recovery points and outbox payloads. pyca/cryptography is the
        # maintained binding to OpenSSL's AEAD; nothing we would write is safer.
        "crypto": ["cryptography>=42"],
        # The benchmarks' plots (python -m bench.run, bench.run_more); the tables need
        # nothing extra. The set-ups python -m bench.telemetry compares (without them
        # it leaves those variants out and says so).
        "bench": [
            "matplotlib>=3.7",
            "opentelemetry-sdk>=1.27",
            "opentelemetry-exporter-prometheus>=0.48b0",
            "opentelemetry-instrumentation-flask>=0.48b0",
        ],
    },
    entry_points={
        # The testing kit's fixtures (api, db, fault, downstream), inert until a
        # test requests one; loading it imports pytest only. Named as its module,
        # so that ``-p flask_idempotency_pytest`` (or the package's
        # ``flask_idempotency.testing.plugin``, which loads it) is the same plugin.
        "pytest11": ["flask_idempotency_pytest = flask_idempotency_pytest"],
    },
    classifiers=[
        "Framework :: Flask",
        "Programming Language :: Python :: 3",
        "Typing :: Typed",
    ],
)
