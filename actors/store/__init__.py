"""The durable store of the Responses API (`store: true` responses, `previous_response_id`).

- `base`: the small interface every backend implements (`ResponseStore`), the record it keeps
  (`StoredResponse`) and the deploy-file settings (`ResponseStoreConfig`).
- `sqlite`: the default backend, an embedded SQLite database in a directory.
- `deployment`: the `response-store` Serve deployment, one replica, the one owner of the
  database that every ingress replica (on any node) reaches through its handle.
"""
