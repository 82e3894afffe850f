"""A user's app with a view that commits in two stages (debit, then credit)."""
import sqlalchemy as sa
from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency

db = SQLAlchemy()
idem = Idempotency()


class Move(db.Model):
    __tablename__ = "moves"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    account: orm.Mapped[str] = orm.mapped_column(db.String(32))
    amount: orm.Mapped[int]


charges = sa.Table(
    "charges", db.metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("amount", sa.Integer),
)


class Audit(db.Model):
    __tablename__ = "audit"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    what: orm.Mapped[str] = orm.mapped_column(db.String(64))


def create_app(config=None):
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite://"
    app.config["IDEMPOTENCY_SCOPE"] = lambda: "user:1"
    app.config.update(config or {})
    db.init_app(app)
    idem.init_app(app, db)

    @app.post("/transfer")
    @idem.idempotent
    def transfer():
        amount = request.get_json()["amount"]
        db.session.add(Move(account="a", amount=-amount))
        db.session.commit()  # stage 1
        db.session.add(Move(account="b", amount=amount))
        db.session.commit()  # stage 2
        return {"ok": True}, 201

    @app.post("/pay")
    @idem.idempotent
    def pay():
        # The charge with Core, committed at once; then an ORM audit row.
        db.session.execute(sa.insert(charges).values(amount=request.get_json()["amount"]))
        db.session.commit()
        db.session.add(Audit(what="charged"))
        return {"ok": True}, 201

    return app
