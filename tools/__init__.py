"""The `llmgw` command and what it runs around the services: the local stack (`llmgw up`: its
launcher and supervisor, the process executor, an embedded PostgreSQL), Envoy's config
(`render-envoy`), the certificates of mutual TLS (`certs`) and the usage report (`usage`).
Not part of the services' image; the tests and benchmarks run their stacks with it."""
