"""The lighthouse's Prometheus metrics: :func:`render_metrics` turns the status the lighthouse
reports (``LighthouseServer.status()``) into the text exposition format its dashboard serves at
``/metrics``. Pure: a status dict in, text out. It names replicas by id and lists numbers only,
never an address."""

from __future__ import annotations

from typing import List


def _prom_escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_metrics(status: dict) -> str:
    lines: List[str] = []

    def metric(name: str, kind: str, help_: str, samples) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_prom_escape(str(v))}"' for k, v in labels.items())
            lines.append(f"{name}{{{lab}}} {value}" if lab else f"{name} {value}")

    q = status["quorum"]
    st = status["stats"]
    metric(
        "ft_lighthouse_quorum_id",
        "gauge",
        "Id of the current quorum (0: none yet).",
        [({}, q["quorum_id"] if q else 0)],
    )
    metric(
        "ft_lighthouse_quorum_members",
        "gauge",
        "Members of the current quorum.",
        [({}, len(q["members"]) if q else 0)],
    )
    metric(
        "ft_lighthouse_quorum_age_seconds",
        "gauge",
        "Seconds since the current quorum was issued.",
        [({}, q["age_s"] if q else 0)],
    )
    metric(
        "ft_lighthouse_participants",
        "gauge",
        "Replicas waiting for the next quorum.",
        [({}, len(status["next_quorum"]["participants"]))],
    )
    metric(
        "ft_lighthouse_heartbeat_age_seconds",
        "gauge",
        "Seconds since each replica's last heartbeat.",
        [
            ({"replica_id": r["replica_id"]}, r["heartbeat_age_s"])
            for r in status["replicas"]
            if r["heartbeat_age_s"] is not None
        ],
    )
    metric(
        "ft_lighthouse_replica_alive",
        "gauge",
        "1 if the replica's heartbeat is fresh.",
        [({"replica_id": r["replica_id"]}, int(r["alive"])) for r in status["replicas"]],
    )
    metric(
        "ft_lighthouse_quorum_latency_seconds",
        "gauge",
        "Time from the first participant joining to the quorum being issued (last round).",
        [({}, st["last_quorum_latency_s"])],
    )
    metric(
        "ft_lighthouse_quorum_latency_median_seconds",
        "gauge",
        "Median quorum latency over the last 1000 rounds.",
        [({}, st["median_quorum_latency_s"])],
    )
    metric(
        "ft_lighthouse_quorums_total", "counter", "Quorums issued.", [({}, st["quorums_issued"])]
    )
    metric(
        "ft_lighthouse_native_rounds_total",
        "counter",
        "Quorums issued by the native server's steady round (without Python).",
        [({}, st["native_rounds"])],
    )
    metric(
        "ft_lighthouse_quorum_changes_total",
        "counter",
        "Quorums with a new quorum_id.",
        [({}, st["quorum_changes"])],
    )
    metric(
        "ft_lighthouse_failure_notifications_total",
        "counter",
        "Failure notifications sent (heartbeat expiries of quorum members).",
        [({}, st["failure_notifications"])],
    )
    metric(
        "ft_lighthouse_failure_subscribers",
        "gauge",
        "Open SubscribeFailures streams.",
        [({}, st["subscribers"])],
    )
    return "\n".join(lines) + "\n"
