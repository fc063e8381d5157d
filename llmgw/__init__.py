"""llmgw: the library every service imports — the contracts between the parts (wire names, request
facts, tenant context, outcome, fleet load, tier table, Redis keys and Lua preludes) and what each
process is built on (settings, serving, reload, telemetry, TLS, the Redis client). It imports no
service and no tool (tests/llmgw/test_layout.py); `python -m llmgw` is the entry point of the
`llmgw` command, which lives in tools/."""
