"""`python -m router.collectors`: the collectors' process a router starts (router/collectors/
process.py); not run by hand. It ends when its stdin does: SIGINT and SIGTERM sent to the
process group (Ctrl-C, a supervisor stopping the router) are its parent's to act on, and the
parent drains its checks with the pods still scraped."""

from __future__ import annotations

import signal

import uvloop

from router.collectors.process import child

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    uvloop.run(child())
