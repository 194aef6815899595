"""Striped heal across simulated hosts: a receiver takes disjoint ranges of one checkpoint from
donors on separate hosts at once (HTTPTransport.recv_checkpoint_striped), every request signed
with the job secret.

Each donor's link is rate-limited (tc tbf on its host's interface), as a real donor's link is
what limits a cross-host heal; so every donor has ranges in flight at once. The tests assert
what the receiver got (bitwise equal to the donors' state) and what each donor served (its own
count of data bytes sent), never how long anything took: the speed is measured by
bench/heal_bench.py.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Dict, List

from ft.utils.auth import JobSecret
from tests.procs import REPO

MIB = 24  # the state: enough ranges (16) for every donor to serve some
STEP = 7
RATE = "80mbit"  # each donor's link: 24 MiB take ~2.5 s from one donor, ~1 s from three
SLOW_RATE = "16mbit"  # the fault case: the heal must still be running when a link goes down
CUT_AFTER_S = 1.5
LIFETIME_S = 60.0


def _env(tmp: str) -> Dict[str, str]:
    secret_file = os.path.join(tmp, "job-secret")
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(JobSecret.generate().export())
    return {
        "PYTHONPATH": REPO,
        "FT_JOB_SECRET_FILE": secret_file,
        "FT_JOB_SECRET": "",
        "FT_ADVERTISE_HOST": "",
        "OMP_NUM_THREADS": "1",
    }


def _event(proc, name: str, timeout: float) -> dict:
    line = proc.wait_for_line(rf'"event": "{name}"', timeout=timeout)
    return json.loads(line)


def _start(hosts, tmp: str, donors: List[str], rate: str, stall_s: float = 5.0):
    env = _env(tmp)
    stop_file = os.path.join(tmp, "stop")
    procs = {}
    for i, name in enumerate(donors):
        # the donor's sending side: tbf on its host's end of the link
        hosts.run(
            name,
            [
                "tc",
                "qdisc",
                "add",
                "dev",
                f"eth{i + 1}",
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "32kb",
                "latency",
                "400ms",
            ],
        )
        cfg = {
            "role": "donor",
            "addr": hosts.addr[name],
            "mib": MIB,
            "step": STEP,
            "stop_file": stop_file,
            "lifetime": LIFETIME_S,
        }
        procs[name] = hosts.popen(
            name,
            [sys.executable, "-m", "tests.multihost.heal_peer", json.dumps(cfg)],
            os.path.join(tmp, f"{name}.log"),
            env=env,
        )
    urls = [_event(procs[name], "ready", 60)["url"] for name in donors]
    cfg = {
        "role": "receiver",
        "addr": hosts.addr["rx"],
        "mib": MIB,
        "step": STEP,
        "sources": urls,
        "stall_s": stall_s,
        "lifetime": LIFETIME_S,
    }
    rx = hosts.popen(
        "rx",
        [sys.executable, "-m", "tests.multihost.heal_peer", json.dumps(cfg)],
        os.path.join(tmp, "rx.log"),
        env=env,
    )
    return procs, urls, rx, stop_file


def _served(procs, stop_file: str, donors: List[str]) -> Dict[str, int]:
    open(stop_file, "w").close()
    return {name: _event(procs[name], "served", 30)["bytes"] for name in donors}


def test_receiver_heals_from_three_donors_bitwise_with_bytes_from_each(hosts_factory):
    hosts = hosts_factory(["rx", "d1", "d2", "d3"])
    donors = ["d1", "d2", "d3"]
    with tempfile.TemporaryDirectory(prefix="ft-stripe-") as tmp:
        procs, urls, rx, stop_file = _start(hosts, tmp, donors, RATE)
        healed = _event(rx, "healed", 60)
        served = _served(procs, stop_file, donors)
    total = MIB << 20
    assert healed["equal"], healed
    # every donor sent part of the state (its own count), and together exactly all of it
    assert all(served[name] > 0 for name in donors), served
    assert sum(served.values()) == total, served
    assert healed["served"] == {url: served[name] for url, name in zip(urls, donors)}


def test_donor_link_down_mid_heal_completes_from_the_others(hosts_factory):
    hosts = hosts_factory(["rx", "d1", "d2", "d3"])
    donors = ["d1", "d2", "d3"]
    with tempfile.TemporaryDirectory(prefix="ft-stripe-") as tmp:
        procs, urls, rx, stop_file = _start(hosts, tmp, donors, SLOW_RATE, stall_s=1.0)
        _event(rx, "fetching", 60)
        # d2's link goes down mid-heal: at this rate every range takes ~0.75 s and the whole
        # heal ~4 s, so d2 is in the middle of a range then
        time.sleep(CUT_AFTER_S)
        hosts.partition("d2")
        healed = _event(rx, "healed", 60)
        dropped = [line for line in rx.lines if "dropped source" in line]
        hosts.restore("d2")
        served = _served(procs, stop_file, donors)
    total = MIB << 20
    assert healed["equal"], healed
    # d2 is gone for the rest of the heal: the others served everything it did not finish
    got = {name: healed["served"][url] for url, name in zip(urls, donors)}
    assert got["d1"] > 0 and got["d3"] > 0, got
    assert sum(got.values()) == total, got
    assert got["d2"] < total // 3, got
    # d2 was dropped mid-heal (a stall on a range, not a refusal), and no other donor was
    assert len(dropped) == 1 and urls[1] in dropped[0], dropped
    # the donors still up counted exactly what the receiver took from them
    assert served["d1"] == got["d1"] and served["d3"] == got["d3"], (served, got)
