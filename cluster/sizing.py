#!/usr/bin/env python3
"""Redis memory per hold, for the README's sizing figures.

Starts a fresh `seathold dev` (3 masters, 1 replica each) on loopback, makes
holds through the HTTP API, and reports `used_memory` summed over the masters
before and after, per hold and per seat. Stops the daemon (and so its
cluster) at the end. Needs python3, redis-cli and a built seathold.

    cluster/sizing.py [--bin target/release/seathold] [--holds 10000]
"""

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time


def used_memory(ports):
    total = 0
    for port in ports:
        info = subprocess.run(
            ["redis-cli", "-p", str(port), "info", "memory"],
            capture_output=True, text=True, check=True,
        ).stdout
        total += int(re.search(r"^used_memory:(\d+)", info, re.M).group(1))
    return total


def masters(ports):
    out = []
    for port in ports:
        info = subprocess.run(
            ["redis-cli", "-p", str(port), "info", "replication"],
            capture_output=True, text=True, check=True,
        ).stdout
        if "role:master" in info:
            out.append(port)
    return out


def measure(conn, ports, holds, seats, confirm, shows=50):
    before = used_memory(ports)
    for i in range(holds):
        show = f"size{seats}{'c' if confirm else ''}{shows}-{i % shows}"
        body = json.dumps({"seats": [f"R{i}-{j}" for j in range(seats)]})
        conn.request("POST", f"/v1/shows/{show}/holds", body, {"content-type": "application/json"})
        resp = conn.getresponse()
        hold = json.loads(resp.read())
        if resp.status != 201:
            sys.exit(f"hold answered {resp.status}: {hold}")
        if confirm:
            conn.request("POST", f"/v1/shows/{show}/holds/{hold['holdToken']}/confirm")
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                sys.exit(f"confirm answered {resp.status}")
    grown = used_memory(ports) - before
    kind = "sold" if confirm else "live"
    print(f"{holds} {kind} holds of {seats} seat(s) on {shows} shows: {grown / holds:.0f} bytes per hold, "
          f"{grown / holds / seats:.0f} per seat (sum over masters; replicas hold as much again)")
    return grown / holds


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", default=os.path.join(here, "..", "target", "release", "seathold"))
    parser.add_argument("--holds", type=int, default=10000)
    args = parser.parse_args()

    daemon = subprocess.Popen(
        [args.bin, "dev", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "SEATHOLD_LOG": "warn"},
    )
    try:
        nodes, url = None, None
        for line in daemon.stdout:
            if line.startswith("Redis Cluster nodes:"):
                nodes = [int(u.rsplit(":", 1)[1]) for u in line.split(":", 1)[1].strip().split(",")]
            if "serving on" in line:
                url = line.split("serving on", 1)[1].split()[0]
                break
        if not nodes or not url:
            sys.exit("seathold dev did not start")
        host, port = url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        for _ in range(200):
            try:
                conn.request("GET", "/readyz")
                resp = conn.getresponse()
                resp.read()
                if resp.status == 200:
                    break
            except OSError:
                conn = http.client.HTTPConnection(host, int(port), timeout=10)
            time.sleep(0.05)
        ports = masters(nodes)
        one = measure(conn, ports, args.holds, 1, False)
        measure(conn, ports, args.holds, 4, False)
        measure(conn, ports, args.holds // 2, 4, True)
        # One hold per show: each also creates its show's event stream and
        # deadline index, which stay (the stream capped) after the holds end.
        alone = measure(conn, ports, args.holds, 1, False, shows=args.holds)
        print(f"a show's event stream and deadline index with one hold: {alone - one:.0f} bytes")
    finally:
        daemon.send_signal(signal.SIGINT)
        daemon.wait(timeout=30)


if __name__ == "__main__":
    main()
