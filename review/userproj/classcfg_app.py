"""The app-factory pattern of the Flask Mega-Tutorial and many cookiecutters:
create_app(env=None), config classes loaded with from_object."""
import os

from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency

db = SQLAlchemy()
idem = Idempotency()


class Config:
    SQLALCHEMY_DATABASE_URI = os.environ.get(
        "DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1/kitrev_production"
    )


class Order(db.Model):
    __tablename__ = "orders"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    item: orm.Mapped[str] = orm.mapped_column(db.String(64))


class TestingConfig(Config):
    SQLALCHEMY_DATABASE_URI = "sqlite://"


def create_app(env=None):
    app = Flask(__name__)
    app.config.from_object(Config)
    if env == "testing":
        app.config.from_object(TestingConfig)
    db.init_app(app)
    idem.init_app(app, db)

    @app.post("/orders")
    @idem.idempotent
    def create_order():
        order = Order(item=request.get_json()["item"])
        db.session.add(order)
        db.session.flush()
        return {"id": order.id}, 201

    return app
