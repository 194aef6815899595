"""The deployment files of docs/multihost.md (examples/deploy/) hold together: every manifest
parses, every ft-lighthouse command line is accepted by ft-lighthouse's own parser, every
torchrun command line by torchrun's, and the groups dial the lighthouse Service's name and
port. A dry check: nothing here starts a cluster."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import subprocess

import pytest
import yaml

from ft.coordination.cli import build_parser
from tests.procs import REPO

DEPLOY = os.path.join(REPO, "examples", "deploy")


def lighthouse_args(argv):
    return build_parser().parse_args(argv)


def torchrun_args(argv):
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(argv)


def load(name):
    with open(os.path.join(DEPLOY, "k8s", name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def test_k8s_lighthouse_deployment_and_service_agree():
    docs = {d["kind"]: d for d in load("lighthouse.yaml")}
    dep, svc = docs["Deployment"], docs["Service"]
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    assert svc["spec"]["selector"] == pod["metadata"]["labels"]
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["ft-lighthouse"]
    args = lighthouse_args(c["args"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert args.bind.endswith(f":{ports['grpc']}") and args.http_bind.endswith(
        f":{ports['dashboard']}")
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in ports


@pytest.mark.parametrize("name", ["groups-jobset.yaml", "groups-indexed-job.yaml"])
def test_k8s_groups_dial_the_lighthouse_service(name):
    svc = next(d for d in load("lighthouse.yaml") if d["kind"] == "Service")
    grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    (doc,) = load(name)
    if doc["kind"] == "JobSet":
        (rj,) = doc["spec"]["replicatedJobs"]
        pod = rj["template"]["spec"]["template"]
    else:
        assert doc["kind"] == "Job" and doc["spec"]["completionMode"] == "Indexed"
        pod = doc["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["torchrun"]
    targs = torchrun_args(c["args"])
    assert targs.rdzv_backend == "c10d" and targs.max_restarts >= 1
    env = env_of(c)
    assert env["TORCHFT_LIGHTHOUSE"]["value"] == f"http://{svc['metadata']['name']}:{grpc_port}"
    assert env["FT_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "fieldRef" in env["REPLICA_GROUP_ID"]["valueFrom"]


def test_systemd_unit_runs_a_valid_lighthouse_command():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(os.path.join(DEPLOY, "ft-lighthouse.service"))
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert argv[0].endswith("/ft-lighthouse")
    args = lighthouse_args(argv[1:])
    assert args.min_replicas >= 1 and args.quorum_id_file
    assert unit["Service"]["Restart"] == "always"


def test_dockerfile_entrypoint_is_a_valid_lighthouse_command():
    with open(os.path.join(DEPLOY, "Dockerfile.lighthouse")) as f:
        text = f.read()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert entry[0] == "ft-lighthouse"
    lighthouse_args(entry[1:] + cmd)


def test_sbatch_script_is_valid_bash_with_valid_commands():
    path = os.path.join(DEPLOY, "slurm", "train.sbatch")
    subprocess.run(["bash", "-n", path], check=True, timeout=10)
    with open(path) as f:
        text = f.read()
    lh = re.search(r"ft-lighthouse (.*)&", text).group(1)
    lighthouse_args(shlex.split(lh.replace('"${LIGHTHOUSE_ADDR}', '"10.0.0.1')))
    tr = re.search(r"^\s+torchrun (.*?) &&", text, re.S | re.M).group(1)
    targs = torchrun_args(shlex.split(tr.replace("\\\n", " ")))
    assert targs.rdzv_backend == "c10d"
