"""The collectors that feed the fleet's datastore (router/fleet.py), each a loop or a stream of
its own, as in the inference extension's data layer:

- `resolver.py`: which pods there are (static `host:port` list, a DNS name).
- `scraper.py`: each pod's `/metrics` and `/v1/models` (read by `scrape.py`).
- `outcomes.py`: how each picked request ended, from Envoy's access log.
- `kvevents.py`: each pod's KV-cache events (which prefix blocks it holds), into the KV index.
"""
