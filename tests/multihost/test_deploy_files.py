"""The deployment files of docs/multihost.md (examples/deploy/) hold together: every manifest
parses, every ft-lighthouse command line is accepted by ft-lighthouse's own parser, every
torchrun command line by torchrun's, and the groups dial the lighthouse Service's name and
port. Every deployment runs authenticated: the lighthouse and every group get the job secret
as a file named by FT_JOB_SECRET_FILE (a read-only Kubernetes Secret volume, a systemd
credential, a per-job file under Slurm), no file holds a secret value, and none turns on
insecure mode. A dry check: nothing here starts a cluster."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import stat
import subprocess
import sys

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
        f":{ports['dashboard']}"
    )
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


# --- the job secret -----------------------------------------------------------------------

SECRET_NAME = "ft-job-secret"  # the Kubernetes Secret the user creates (lighthouse.yaml says how)


def deploy_files():
    for root, _, names in os.walk(DEPLOY):
        for n in sorted(names):
            yield os.path.join(root, n)


def pod_specs(name):
    """(container, pod spec) of every container of a manifest."""
    out = []
    for doc in load(name):
        if doc["kind"] == "Deployment":
            pod = doc["spec"]["template"]
        elif doc["kind"] == "JobSet":
            (rj,) = doc["spec"]["replicatedJobs"]
            pod = rj["template"]["spec"]["template"]
        elif doc["kind"] == "Job":
            pod = doc["spec"]["template"]
        else:
            continue
        out += [(c, pod["spec"]) for c in pod["spec"]["containers"]]
    return out


@pytest.mark.parametrize(
    "name", ["lighthouse.yaml", "groups-jobset.yaml", "groups-indexed-job.yaml"]
)
def test_k8s_every_container_reads_the_job_secret_from_a_read_only_secret_volume(name):
    specs = pod_specs(name)
    assert specs
    for c, spec in specs:
        env = env_of(c)
        path = env["FT_JOB_SECRET_FILE"]["value"]
        assert "FT_JOB_SECRET" not in env and "FT_INSECURE" not in env
        (mount,) = [
            m
            for m in c.get("volumeMounts", [])
            if path.startswith(m["mountPath"].rstrip("/") + "/")
        ]
        assert mount["readOnly"] is True
        assert "subPath" not in mount  # a subPath mount never sees the Secret's updates
        (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        secret = vol["secret"]
        assert secret["secretName"] == SECRET_NAME
        mode = secret.get("defaultMode", 0o644)
        assert mode & 0o077 == 0, f"{name}: secret volume mode {mode:o} lets others read it"
        file_in_volume = path[len(mount["mountPath"].rstrip("/")) + 1 :]
        keys = {i["path"]: i["key"] for i in secret.get("items", [])}
        assert file_in_volume in keys, f"{name}: {path} is not a file of the Secret volume"
        assert all(i.get("mode", mode) & 0o077 == 0 for i in secret.get("items", []))


def test_k8s_lighthouse_and_groups_mount_the_same_secret_key():
    seen = set()
    for name in ("lighthouse.yaml", "groups-jobset.yaml", "groups-indexed-job.yaml"):
        for c, spec in pod_specs(name):
            path = env_of(c)["FT_JOB_SECRET_FILE"]["value"]
            (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
            (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
            item = {i["path"]: i["key"] for i in vol["secret"]["items"]}[os.path.basename(path)]
            seen.add((vol["secret"]["secretName"], item))
    assert len(seen) == 1, seen


def test_no_deploy_file_holds_a_secret_or_turns_on_insecure_mode():
    for path in deploy_files():
        with open(path) as f:
            text = f.read()
        rel = os.path.relpath(path, DEPLOY)
        # Only the file's path travels in the environment, never the value.
        assert not re.search(r"FT_JOB_SECRET(?!_FILE)", text), rel
        assert "FT_INSECURE" not in text and "--insecure" not in text, rel
        assert not re.search(r"\b[0-9a-fA-F]{32,}\b", text), f"{rel}: looks like a secret value"
        if path.endswith((".yaml", ".yml")):
            for doc in yaml.safe_load_all(text):
                assert not doc or doc["kind"] != "Secret", f"{rel}: a Secret belongs to the user"


def test_systemd_unit_hands_the_lighthouse_the_job_secret_as_a_credential():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(os.path.join(DEPLOY, "ft-lighthouse.service"))
    svc = unit["Service"]
    cred, _, source = svc["LoadCredential"].partition(":")
    assert cred and os.path.isabs(source)
    env = dict(kv.split("=", 1) for kv in shlex.split(svc["Environment"]))
    assert env["FT_JOB_SECRET_FILE"] == f"%d/{cred}"
    args = lighthouse_args(shlex.split(svc["ExecStart"])[1:])
    assert not args.insecure and args.secret_file is None  # the environment names it
    # Without --bind the lighthouse listens on this host's advertised address, port 29510.
    assert args.bind is None or not args.bind.startswith(("0.0.0.0", "[::]"))


def test_dockerfile_names_a_mounted_secret_file_and_holds_none():
    with open(os.path.join(DEPLOY, "Dockerfile.lighthouse")) as f:
        text = f.read()
    (path,) = re.findall(r"^ENV FT_JOB_SECRET_FILE=(\S+)$", text, re.M)
    assert os.path.isabs(path)
    # The file is mounted at run time, never built into the image.
    for m in re.finditer(r"^(?:COPY|ADD) (.*)$", text, re.M):
        assert "secret" not in m.group(1).lower()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert not lighthouse_args(entry[1:] + cmd).insecure


def test_sbatch_gives_the_lighthouse_and_every_group_a_private_per_job_secret(tmp_path):
    """Runs train.sbatch with srun and scontrol stubbed: each srun (the lighthouse's and the
    groups') sees FT_JOB_SECRET_FILE naming a valid secret that only the user can read, and
    the file is gone when the job ends."""
    from ft.utils.auth import JobSecret

    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    home.mkdir()
    log = tmp_path / "srun.log"
    stubs = {
        "scontrol": 'printf "node1\\nnode2\\n"\n',
        "python": f'PYTHONPATH={shlex.quote(REPO)} exec {shlex.quote(sys.executable)} "$@"\n',
        # One line per srun: its command, and what it sees of the secret. The groups' srun
        # returns only once the (backgrounded) lighthouse srun has logged, as a real one would
        # run for the whole job.
        "srun": f"""LOG={shlex.quote(str(log))}
case "$*" in
  *hostname*) echo 10.0.0.1; exit 0;;
  *ft-lighthouse*) what=lighthouse;;
  *torchrun*) what=groups
    for _ in $(seq 100); do grep -q '^lighthouse' "$LOG" 2>/dev/null && break; sleep 0.1; done;;
  *) what=other;;
esac
f="${{FT_JOB_SECRET_FILE:-}}"
if [ -n "$f" ] && [ -f "$f" ]; then
  echo "$what $f $(stat -c %a "$f") $(stat -c %a "$(dirname "$f")") $(cat "$f")" >> "$LOG"
else
  echo "$what none" >> "$LOG"
fi
""",
    }
    for name, body in stubs.items():
        p = bin_dir / name
        p.write_text("#!/bin/bash\n" + body)
        p.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(home),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
    }
    subprocess.run(
        ["bash", os.path.join(DEPLOY, "slurm", "train.sbatch")],
        cwd=tmp_path,
        env=env,
        check=True,
        timeout=60,
    )
    lines = [ln.split() for ln in log.read_text().splitlines()]
    assert sorted(ln[0] for ln in lines) == ["groups", "lighthouse"], lines
    paths = set()
    for line in lines:
        assert len(line) == 5, f"{line[0]}'s srun has no readable FT_JOB_SECRET_FILE"
        what, path, file_mode, dir_mode, value = line
        assert path.startswith(str(home) + "/") and "4242" in path, (what, path)
        assert stat.S_IMODE(int(file_mode, 8)) & 0o077 == 0, (what, file_mode)
        assert stat.S_IMODE(int(dir_mode, 8)) & 0o077 == 0, (what, dir_mode)
        JobSecret(value)  # long enough
        paths.add((path, value))
    assert len(paths) == 1  # one secret for the whole job
    ((path, _),) = paths
    assert not os.path.exists(path), "the job's secret outlived the job"
