"""TLS and node authentication on the real Deployment Engine, as docs/flower.md describes them for several
machines: a SuperLink with its own CA-signed certificate that admits only SuperNodes whose public keys were
registered with `flwr supernode register`, a fedtailor run on the registered nodes, and two intruders refused:
a node with a key that was never registered, and a node with no key."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Self

import pytest

pytest.importorskip("flwr")
pytest.importorskip("cryptography", reason="the certificates and node keys are made with `cryptography`")

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from test_flower import Federation, _free_port, _history, _wait_for

from conftest import TINY_TOML

ROUNDS, CLIENTS = 2, 2  # a deployment round is ~10-20 s here; two rounds show the nodes keep getting work


def _certificate(subject: str, key, issuer: x509.Certificate | None, issuer_key, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=10))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:  # what the nodes, the flwr CLI and the SuperLink's SuperExec dial
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def make_pki(folder: Path, node_names: list[str]) -> dict[str, Path]:
    """A CA, the SuperLink's certificate signed by it (SANs 127.0.0.1 and localhost), and one ECDSA P-384 key
    pair per node in OpenSSH format (what `flower-supernode --auth-supernode-private-key` and `flwr supernode
    register` read)."""
    folder.mkdir()
    ca_key, link_key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca = _certificate("fedtailor test CA", ca_key, None, ca_key, ca=True)
    link = _certificate("localhost", link_key, ca, ca_key, ca=False)
    enc = serialization.Encoding
    files = {
        "ca": _pem(folder / "ca.crt", ca.public_bytes(enc.PEM)),
        "cert": _pem(folder / "server.pem", link.public_bytes(enc.PEM)),
        "key": _pem(
            folder / "server.key",
            link_key.private_bytes(enc.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        ),
    }
    for name in node_names:
        key = ec.generate_private_key(ec.SECP384R1())
        files[name] = _pem(
            folder / name, key.private_bytes(enc.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
        )
        files[f"{name}.pub"] = _pem(
            folder / f"{name}.pub", key.public_key().public_bytes(enc.OpenSSH, serialization.PublicFormat.OpenSSH)
        )
        files[f"{name}.spki"] = _pem(
            folder / f"{name}.spki.pem",
            key.public_key().public_bytes(enc.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
        )  # how the SuperLink logs a key
    return files


def _json(stdout: str):
    return json.loads(stdout[stdout.index("{") :])


class SecureFederation(Federation):
    """`Federation` with TLS (the SuperLink's certificate signed by a test CA) and SuperNode authentication:
    the public keys of the `nodes` SuperNodes are registered with `flwr supernode register` before they
    start. Two intruders start beside them, both claiming client 0: `unregistered`, with a fresh key never
    registered, and `anonymous`, with no key at all (which a SuperLink without `--enable-supernode-auth` would
    let register itself). Every process logs to a file; `logs()` gathers them for the assertion messages."""

    INTRUDERS = ("unregistered", "anonymous")

    def __init__(self, tmp_path: Path, nodes: int) -> None:
        super().__init__(tmp_path, nodes)
        self.env["PATH"] = f"{self.bin}:{self.env.get('PATH', '')}"  # the SuperLink starts `flower-superexec`
        self.names = [f"node{i}" for i in range(nodes)]
        self.pki = make_pki(tmp_path / "pki", [*self.names, "unregistered"])
        (self.home / "config.toml").write_text(
            f'[superlink.deploy]\naddress = "127.0.0.1:{self.link}"\nroot-certificates = "{self.pki["ca"]}"\n'
        )
        self.link_log = self.home / "superlink.log"
        self.node_ids: list[str] = []
        self.intruders: dict[str, subprocess.Popen] = {}

    def log(self, name: str) -> Path:
        return self.home / f"{name}.log"

    def logs(self) -> str:
        paths = [self.link_log, *self.node_logs, *map(self.log, self.INTRUDERS)]
        parts = [f"--- {p.name}:\n{p.read_text()[-3000:]}" for p in paths if p.exists()]
        return "\n".join(parts)

    def https_health(self) -> bool:
        ctx = ssl.create_default_context(cafile=str(self.pki["ca"]))  # verifies the chain and the IP SAN
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{self.link}/health", context=ctx, timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def flwr(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.bin / "flwr", *args], env=self.env, capture_output=True, text=True, timeout=120, check=False
        )

    def _node(self, name: str, partition: int) -> subprocess.Popen:
        key = ["--auth-supernode-private-key", str(self.pki[name])] if name in self.pki else []
        return subprocess.Popen(
            [
                self.bin / "flower-supernode",
                "--root-certificates",
                str(self.pki["ca"]),
                "--superlink",
                f"127.0.0.1:{self.link}",
                *key,
                "--port",
                str(_free_port()),
                "--node-config",
                f"partition-id={partition}",
            ],
            env=self.env,
            stdout=self.log(name).open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        p = self.pki
        self.procs.append(
            subprocess.Popen(
                [
                    self.bin / "flower-superlink",
                    "--ssl-ca-certfile",
                    str(p["ca"]),
                    "--ssl-certfile",
                    str(p["cert"]),
                    "--ssl-keyfile",
                    str(p["key"]),
                    "--enable-supernode-auth",
                    "--disable-runtime-dependency-installation",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.link),
                ],
                env=self.env,
                stdout=self.link_log.open("w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        for _ in range(240):  # up to about two minutes for the SuperLink to answer over TLS
            if self.https_health():
                break
            assert self.procs[0].poll() is None, "the TLS SuperLink exited:\n" + self.logs()
            time.sleep(0.5)
        else:
            raise AssertionError("no TLS SuperLink:\n" + self.logs())
        for name in self.names:  # the operator registers each node's public key once
            reg = self.flwr("supernode", "register", str(p[f"{name}.pub"]), "deploy", "--format", "json")
            assert reg.returncode == 0, f"register {name}: {reg.stdout}{reg.stderr}\n{self.logs()}"
            self.node_ids.append(str(_json(reg.stdout)["node-id"]))
        for i, name in enumerate(self.names):
            self.procs.append(self._node(name, i))
            self.node_logs.append(self.log(name))
        for name in self.INTRUDERS:
            self.intruders[name] = self._node(name, 0)
            self.procs.append(self.intruders[name])

    def wait_refused(self, name: str, seconds: float = 60) -> str:
        """An intruder's log once it has exited on its own (asserts it exited, with an error)."""
        proc, deadline = self.intruders[name], time.time() + seconds
        while proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert proc.returncode not in (None, 0), f"the {name} SuperNode was not refused:\n{self.logs()}"
        return self.log(name).read_text()

    def listed(self) -> dict[str, str]:
        """Node id -> status, as the SuperLink lists its nodes (`flwr supernode ls`)."""
        ls = self.flwr("supernode", "ls", "deploy", "--format", "json")
        assert ls.returncode == 0, f"{ls.stdout}{ls.stderr}\n{self.logs()}"
        return {str(n["node-id"]): n["status"] for n in _json(ls.stdout)["nodes"]}


def _tiny(tmp_path: Path) -> Path:
    cfg_path = tmp_path / "tiny.toml"
    cfg_path.write_text(
        TINY_TOML.replace("num_clients = 6", f"num_clients = {CLIENTS}")
        .replace("num_unseen = 1", "num_unseen = 0")
        .replace("clients_per_round = 3", f"clients_per_round = {CLIENTS}")
        .replace("rounds = 4", f"rounds = {ROUNDS}")
    )
    return cfg_path


@pytest.mark.slow
def test_a_tls_superlink_runs_registered_supernodes_and_refuses_the_others(tmp_path):
    """Two registered SuperNodes run FedAvg over TLS to the end, while two intruders claiming client 0 (one
    with a key never registered, one with no key) are refused when they try to join: each exits on its own,
    the SuperLink logs each refusal, lists only the registered nodes, and the run's clients are exactly the
    registered ones."""
    cfg_path, out = _tiny(tmp_path), tmp_path / "out"
    with SecureFederation(tmp_path, CLIENTS) as fed:
        run = fed.run(cfg_path, out)  # the ServerApp waits for its nodes: no need to poll for them first
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:] + "\n" + fed.logs()
        _wait_for(out / "results.json")
        assert (out / "results.json").exists(), run.stdout[-2000:] + "\n" + fed.logs()
        for node_log in fed.node_logs:  # every registered node got work
            assert "Receiving: train message" in node_log.read_text(), fed.logs()

        # TLS is really on: plain HTTP gets no answer, HTTPS verified against the test CA does
        with pytest.raises((OSError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{fed.link}/health", timeout=5)
        assert fed.https_health()

        # a key never registered: refused at activation (the SuperLink names the key it does not know)
        log = fed.wait_refused("unregistered")
        assert "Failed to activate SuperNode" in log and "Receiving" not in log, fed.logs()
        anonymous = fed.wait_refused("anonymous")
        link_log = fed.link_log.read_text().splitlines()
        key_line = fed.pki["unregistered.spki"].read_text().splitlines()[2]  # a line of that key's own bits
        refused = [line for line in link_log if "/v1/fleet/activate-node" in line and key_line in line]
        assert refused and "No SuperNode found with the given public key" in refused[0], fed.logs()
        # no key: the node tries to register itself, which only node authentication forbids
        assert "All SuperNodes must be registered via the CLI" in anonymous, fed.logs()
        assert "Receiving" not in anonymous, fed.logs()
        assert any("/v1/fleet/register-node" in line and "ApiError" in line for line in link_log), fed.logs()

        # the SuperLink knows the registered nodes (online, under the ids their registration gave), no other
        listed = fed.listed()
        assert listed == dict.fromkeys(fed.node_ids, "online"), f"{listed} vs {fed.node_ids}\n{fed.logs()}"
    results, history = json.loads((out / "results.json").read_text()), _history(out)
    assert results["rounds_completed"] == len(history) == ROUNDS
    assert all(h["lost"] == [] and h["rejected"] == 0 and "loss" in h for h in history)
    assert sorted(r["client"] for r in results["per_client"]) == list(range(CLIENTS))
