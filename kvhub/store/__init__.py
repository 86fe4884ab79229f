"""The store: fitted mapper versions in a SQL database, their artifacts in a content-addressed directory.

    from kvhub.store import open_store

    with open_store() as store:                       # or open_store("postgresql+psycopg://...")
        version = store.register("out/mapper", lineage={"command": "kvhub fit ..."})
        store.add_metrics(version, [{"name": "attn_cos", "value": 0.97, "split": "heldout"}])
        store.tag(version, "production")
        path = store.artifact_path(store.resolve("a:b:legal-docs@production"))

See docs/store.md for where data lives, the reference syntax and the commands.
"""

from kvhub.store.location import resolve_db_url
from kvhub.store.records import MapperVersion
from kvhub.store.refs import Ref
from kvhub.store.store import GcReport, Store, open_store

__all__ = ["GcReport", "MapperVersion", "Ref", "Store", "open_store", "resolve_db_url"]
