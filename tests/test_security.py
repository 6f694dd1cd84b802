"""Heals that run no code and serve only the job (core/security/, core/ft/heals.py).

Real HTTP servers and sockets on loopback; no mocks. The fuzzing is seeded: every run
tries the same payloads.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import pickle
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from hashlib import sha256
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from hier_localsgd.core.ft.heals import MAC_BYTES, HealRefused, HealTransport
from hier_localsgd.core.security.secret import SECRET_ENV, derive, keygen, load_secret, read_secret_file, SecurityConfig
from hier_localsgd.core.security.wire import DTYPES, MAX_DEPTH, WireError, decode, encode
from hier_localsgd.errors import ConfigError

LIMIT = 1 << 30


def same(a, b) -> bool:
    """Equal values, types and tensor bytes (NaNs equal to NaNs)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def a_state() -> dict:
    """A state of every kind the format carries: every dtype, 0-d and empty tensors, an
    optimizer's int-keyed state, tuples, None, NaN and inf, a numpy RNG state."""
    g = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(3, 5, generator=g) * 4).to(d) for name, d in DTYPES.items()}
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(4, 3))], lr=1e-3)
    opt.param_groups[0]["params"][0].grad = torch.ones(4, 3)
    opt.step()
    return {
        "tensors": tensors,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 7),
        "strided": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        "optimizer": opt.state_dict(),
        "counters": {"step": 120, "inner_round": 12, "big": 2**70, "neg": -3},
        "floats": [0.1, float("nan"), float("inf"), -0.0],
        "misc": (None, True, False, "text ünïcode", (1, (2, 3))),
        "int_keys": {0: "a", 1: [1, 2], (2, 3): None},
        "rng": np.random.RandomState(0).get_state(),
        "torch_rng": torch.get_rng_state(),
        "size": torch.Size([2, 3]),
    }


def test_a_state_of_every_kind_round_trips_exactly():
    state = a_state()
    back = decode(bytearray(encode(state).to_bytes()), LIMIT)
    expect = dict(state, strided=state["strided"].contiguous(), size=(2, 3))
    assert same(back, expect)
    assert back["optimizer"]["state"][0]["exp_avg"].dtype == torch.float32
    assert isinstance(back["rng"][1], np.ndarray) and back["rng"][1].dtype == np.uint32
    # A healed optimizer loads it.
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4, 3))], lr=1.0)
    opt.load_state_dict(back["optimizer"])
    assert opt.param_groups[0]["lr"] == 1e-3


def test_a_dtensor_shard_goes_as_its_local_tensor_and_comes_back_on_the_receivers_mesh(tmp_path):
    """FSDP2's optimizer state holds DTensors: each rank sends its shard; the healing rank
    wraps it on its own mesh with its own placements (heals.rewrap). One process, world 1."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from hier_localsgd.core.ft.heals import rewrap

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sent = {"state": {0: {"exp_avg": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])}}, "step": 3}
        own = {"state": {0: {"exp_avg": distribute_tensor(torch.zeros(8), mesh, [Shard(0)])}}, "step": 0}
        back = rewrap(decode(bytearray(encode(sent).to_bytes()), LIMIT), own)
        t = back["state"][0]["exp_avg"]
        assert isinstance(t, DTensor) and t.placements == own["state"][0]["exp_avg"].placements
        assert torch.equal(t.full_tensor(), torch.arange(8.0)) and back["step"] == 3
        with pytest.raises(HealRefused, match=r"^.state.0.exp_avg: a sharded tensor where this replica holds none"):
            rewrap(decode(bytearray(encode(sent).to_bytes()), LIMIT), {"state": {0: {"exp_avg": torch.zeros(8)}}})
    finally:
        dist.destroy_process_group()


def test_values_the_format_cannot_carry_are_refused_naming_their_path():
    class Custom:
        pass

    for bad, path in [({"a": {"b": Custom()}}, ".a.b"), ({"fn": [1, lambda: 0]}, ".fn[1]"), ({"x": {object(): 1}}, ".x"),
                      ({"s": torch.zeros(3).to_sparse()}, ".s"), ({"q": torch.zeros(2, dtype=torch.complex32)}, ".q")]:
        with pytest.raises(WireError) as e:
            encode(bad)
        assert str(e.value).startswith(path + ":"), e.value


def test_no_pickle_payload_is_ever_decoded():
    """A pickle (torch.save's format, what torchft's transport sends) is refused before any
    byte of it is interpreted: the decoder has no code path to unpickle."""
    marker = Path(os.environ.get("TMPDIR", "/tmp")) / f"pwned-{os.getpid()}"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for blob in (pickle.dumps(Exploit()), _torch_save({"x": torch.ones(2), "e": Exploit()})):
        with pytest.raises(WireError, match="bad magic"):
            decode(bytearray(blob), LIMIT)
    assert not marker.exists()


def _torch_save(obj) -> bytes:
    import io

    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


def _payload(header: dict, body: bytes = b"") -> bytearray:
    import json

    h = json.dumps(header).encode()
    h += b" " * ((-(12 + len(h))) % 64)
    return bytearray(b"HLW1" + struct.pack("<Q", len(h)) + h + body)


def _nest(n: int):
    t = None
    for _ in range(n):
        t = {"L": [t]}
    return t


CRAFTED = [
    ("bad magic", bytearray(b"HLW2" + bytes(60))),
    ("short", bytearray(b"HLW1")),
    ("header past end", bytearray(b"HLW1" + struct.pack("<Q", 10**6) + b"{}")),
    ("huge header", bytearray(b"HLW1" + struct.pack("<Q", 2**62))),
    ("not json", bytearray(b"HLW1" + struct.pack("<Q", 4) + b"{{{{")),
    ("not utf8", bytearray(b"HLW1" + struct.pack("<Q", 2) + b"\xff\xfe")),
    ("keys", _payload({"tree": None})),
    ("extra key", _payload({"tree": None, "tensors": [], "code": "x"})),
    ("dtype object", _payload({"tree": {"X": 0}, "tensors": [["object", [1], 8]]}, bytes(64))),
    ("dtype unknown", _payload({"tree": {"X": 0}, "tensors": [["float128", [1], 16]]}, bytes(64))),
    ("size mismatch", _payload({"tree": {"X": 0}, "tensors": [["float32", [4], 8]]}, bytes(64))),
    ("negative dim", _payload({"tree": {"X": 0}, "tensors": [["float32", [-1], -4]]})),
    ("huge dim of an empty tensor", _payload({"tree": {"X": 0}, "tensors": [["float32", [0, 2**70], 0]]})),
    ("stride overflow of an empty tensor", _payload({"tree": {"X": 0}, "tensors": [["float32", [0, 2**62, 2**62], 0]]})),
    ("bool bytes other than 0 and 1", _payload({"tree": {"X": 0}, "tensors": [["bool", [4], 4]]}, b"\x00\x01\x02\x01" + bytes(60))),
    ("float dim", _payload({"tree": {"X": 0}, "tensors": [["float32", [1.5], 6]]}, bytes(64))),
    ("truncated tensor", _payload({"tree": {"X": 0}, "tensors": [["float32", [1000], 4000]]}, bytes(64))),
    ("trailing bytes", _payload({"tree": None, "tensors": []}, bytes(64))),
    ("index out of range", _payload({"tree": {"X": 1}, "tensors": [["float32", [1], 4]]}, bytes(64))),
    ("index reused", _payload({"tree": {"L": [{"X": 0}, {"X": 0}]}, "tensors": [["float32", [1], 4]]}, bytes(64))),
    ("tensor unreferenced", _payload({"tree": None, "tensors": [["float32", [1], 4]]}, bytes(64))),
    ("bool index", _payload({"tree": {"X": True}, "tensors": [["float32", [1], 4]]}, bytes(64))),
    ("unknown tag", _payload({"tree": {"P": ["os.system", "id"]}, "tensors": []})),
    ("two tags", _payload({"tree": {"L": [], "T": []}, "tensors": []})),
    ("bare list", _payload({"tree": [1, 2], "tensors": []})),
    ("list key", _payload({"tree": {"D": [[{"L": []}, 1]]}, "tensors": []})),
    ("tuple key holding a list", _payload({"tree": {"D": [[{"T": [{"L": []}]}, 1]]}, "tensors": []})),
    ("bad dict item", _payload({"tree": {"D": [[1]]}, "tensors": []})),
    ("too deep", _payload({"tree": _nest(MAX_DEPTH + 5), "tensors": []})),
]


CRAFTED.append(("json bomb", bytearray(b"HLW1" + struct.pack("<Q", 200_000) + b"[" * 200_000)))


@pytest.mark.parametrize("name,payload", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_a_crafted_payload_is_refused_with_one_error(name, payload):
    with pytest.raises(WireError):
        decode(payload, LIMIT)


def test_an_oversized_payload_is_refused_before_parsing():
    blob = bytearray(encode({"x": torch.zeros(1000)}).to_bytes())
    with pytest.raises(WireError, match="exceeds the limit"):
        decode(blob, len(blob) - 1)
    assert same(decode(blob, len(blob)), {"x": torch.zeros(1000)})


def test_random_and_mutated_payloads_never_decode_to_anything_but_an_error_or_a_plain_tree():
    """Seeded fuzz: random bytes, and valid payloads with bytes flipped, cut or appended.
    Every outcome is a WireError or a tree of the allowed types; nothing else escapes."""
    rng = random.Random(1234)
    valid = encode({"model": torch.randn(33, generator=torch.Generator().manual_seed(6)), "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
                    "counters": {"step": 7}}).to_bytes()
    outcomes = {"error": 0, "decoded": 0}

    def plain(v) -> bool:
        if v is None or isinstance(v, (bool, int, float, str, torch.Tensor)):
            return True
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        if isinstance(v, dict):
            return all(plain(k) and plain(x) for k, x in v.items())
        return False

    for i in range(3000):
        kind = i % 4
        if kind == 0:
            blob = bytearray(rng.randbytes(rng.randrange(0, 400)))
            if rng.random() < 0.5:
                blob[:4] = b"HLW1"
        else:
            blob = bytearray(valid)
            if kind == 1:
                for _ in range(rng.randrange(1, 6)):
                    blob[rng.randrange(len(blob))] = rng.randrange(256)
            elif kind == 2:
                blob = blob[: rng.randrange(len(blob))]
            else:
                blob += rng.randbytes(rng.randrange(1, 70))
        try:
            out = decode(blob, LIMIT)
        except WireError:
            outcomes["error"] += 1
        else:
            assert plain(out), type(out)
            outcomes["decoded"] += 1
    # Both outcomes occur (flips inside tensor bytes decode to other values: the MAC of
    # heals.py, not the decoder, catches those), so the fuzz reached past the header.
    assert outcomes["error"] > 1000 and outcomes["decoded"] > 50, outcomes


# -- the job secret --------------------------------------------------------------------------
def test_keygen_writes_an_owner_only_secret_and_never_overwrites(tmp_path, monkeypatch):
    path = tmp_path / "job.secret"
    keygen(str(path))
    assert (path.stat().st_mode & 0o777) == 0o600
    assert len(read_secret_file(str(path))) == 32
    with pytest.raises(ConfigError, match="does not overwrite"):
        keygen(str(path))
    path.chmod(0o640)
    with pytest.raises(ConfigError, match=r"^security.secret_file: .* readable by group or others"):
        read_secret_file(str(path))
    short = tmp_path / "short"
    short.write_text("abcd")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="at least 16"):
        read_secret_file(str(short))
    monkeypatch.setenv(SECRET_ENV, "zz")
    with pytest.raises(ConfigError, match=f"^{SECRET_ENV}: "):
        load_secret(SecurityConfig())
    monkeypatch.setenv(SECRET_ENV, "ab" * 16)
    assert load_secret(SecurityConfig()) == bytes.fromhex("ab" * 16)
    monkeypatch.delenv(SECRET_ENV)
    assert load_secret(SecurityConfig()) is None
    assert "hidden" in repr(derive(b"x" * 16, "heal")) and "78" not in repr(derive(b"x" * 16, "heal"))


def test_keygen_command_and_config_check(tmp_path):
    path = tmp_path / "s"
    cmd = [sys.executable, "-m", "hier_localsgd", "keygen", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and path.exists(), out.stderr
    secret_hex = path.read_text().strip()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "does not overwrite" in again.stderr
    path.chmod(0o644)
    bad = subprocess.run([sys.executable, "-m", "hier_localsgd", "plan", f"security.secret_file={path}", f"run.dir={tmp_path}/r"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "security.secret_file:" in bad.stderr and "chmod 600" in bad.stderr
    assert secret_hex not in bad.stderr + bad.stdout


# -- the heal transport --------------------------------------------------------------------------
KEY = derive(b"s" * 32, "heal").bytes()
OTHER = derive(b"t" * 32, "heal").bytes()
STATE = {"user": {"level": {"model": torch.randn(1000, generator=torch.Generator().manual_seed(5)), "counters": {"step": 40}}}, "torchft": {"step": 4, "batches_committed": 9}}


def transport(key=KEY, timeout=5.0, level="test") -> HealTransport:
    """A heal transport whose own state is STATE (its payload limit: payload_limit of STATE's bytes)."""
    return HealTransport("127.0.0.1", timedelta(seconds=timeout), key, template=lambda: STATE, level=level)


def signed(key: bytes, url: str, ts: str, nonce: str, level: str = "test") -> str:
    """An Authorization header as heals.py signs it (the MAC names the level and the donor's URL)."""
    return f"HL1 {ts} {nonce} {hmac.new(key, f'GET {level} {url} {ts} {nonce}'.encode(), sha256).hexdigest()}"


@pytest.fixture
def donor():
    t = transport()
    t.send_checkpoint([1], 4, STATE, timedelta(seconds=5))
    yield t
    t.shutdown()


def test_a_heal_between_holders_of_the_secret_carries_the_state(donor):
    rx = transport()
    try:
        got = rx.recv_checkpoint(0, donor.metadata(), 4, timedelta(seconds=5))
        assert same(got, STATE)
        assert not donor.refusals
    finally:
        rx.shutdown()


def test_the_heal_server_binds_the_given_address_only(donor):
    host, port = donor.metadata()[len("http://"):].split("/")[0].rsplit(":", 1)
    assert host == "127.0.0.1"
    listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout.split()
    assert f"127.0.0.1:{port}" in listening, listening


def test_a_request_without_the_secret_is_refused_and_logged(donor, caplog):
    url = donor.metadata() + "4"
    with caplog.at_level(logging.WARNING, logger="hier_localsgd.core.ft.heals"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=5)
        assert e.value.code == 403
        rx = transport(key=OTHER)  # another job's secret
        with pytest.raises(HealRefused, match="403"):
            rx.recv_checkpoint(0, donor.metadata(), 4, timedelta(seconds=5))
        rx.shutdown()
    assert list(donor.refusals) == ["no credentials", "bad credentials (not the job's secret, or signed for another donor)"]
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert any("from 127.0.0.1: no credentials" in m for m in lines), lines


def test_a_replayed_request_is_refused(donor):
    url = donor.metadata() + "4"
    ts, nonce = f"{time.time():.3f}", "ab" * 16
    req = lambda: urllib.request.Request(url, headers={"Authorization": signed(KEY, url, ts, nonce)})
    with urllib.request.urlopen(req(), timeout=5) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req(), timeout=5)
    assert e.value.code == 403 and list(donor.refusals) == ["replayed request (nonce seen before)"]
    old = f"{time.time() - 3600:.3f}"
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": signed(KEY, url, old, "cd" * 16)}), timeout=5)
    assert "away from the donor's clock" in donor.refusals[-1]


def test_a_request_signed_for_another_donor_or_level_is_refused(donor):
    """A relay: a healer signed its request for the donor its quorum named (an impostor's
    address, say); the impostor forwards it to a real donor, which refuses it — the MAC
    names the donor's URL and the level. Malformed credentials (non-ASCII, wrong lengths)
    are refused the same way, never with a server error."""
    url = donor.metadata() + "4"
    ts = f"{time.time():.3f}"
    for i, header in enumerate([signed(KEY, "http://10.0.0.9:1234/heal/4", ts, "01" * 16),  # for another donor
                                signed(KEY, url, ts, "02" * 16, level="outer"),  # for another level
                                "HL1 1 " + "ab" * 16 + " " + "\xff" * 64, "HL1 x y z", "Bearer abc"]):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": header.encode("latin-1").decode("latin-1")}), timeout=5)
        assert e.value.code == 403, header
    assert [r.split(" (")[0] for r in donor.refusals] == ["bad credentials", "bad credentials", "malformed credentials",
                                                         "malformed credentials", "malformed credentials"]


class _Attacker:
    """An HTTP server that answers every heal request with ``body`` (a crafted payload)."""

    def __init__(self, body: bytes, length: int | None = None) -> None:
        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.metadata = f"http://127.0.0.1:{self.server.server_address[1]}/heal/"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _exploit_pickle() -> bytes:
    class Exploit:
        def __reduce__(self):
            return (os.system, ("true",))

    return _torch_save({"user": {}, "torchft": {"step": 1}, "x": Exploit()})


ANSWERS = [
    ("pickle", _exploit_pickle(), None, "MAC does not match"),
    ("valid format, no MAC key", encode(STATE).to_bytes() + bytes(MAC_BYTES), None, "MAC does not match"),
    ("MAC under another secret", None, None, "MAC does not match"),
    ("oversized", b"x" * 100, 10**12, "refused"),
    ("truncated", encode(STATE).to_bytes()[:500], 10**5, "truncated"),
    ("no length", b"HTTP/1.0 200 OK\r\n\r\n" + b"HLW1" * 100, -1, "Content-Length"),
    ("a length in other digits", b"HTTP/1.0 200 OK\r\nContent-Length: \xc2\xb2\r\n\r\n" + b"HLW1" * 100, -1, "Content-Length"),
    ("not HTTP", b"GARBAGE\r\n\r\n", -1, "malformed answer"),
]


@pytest.mark.parametrize("name,body,length,why", ANSWERS, ids=[a[0] for a in ANSWERS])
def test_a_crafted_heal_payload_is_refused_by_the_healing_replica(name, body, length, why, caplog):
    if body is None:  # a well-formed answer MACed under another job's key: replay or a foreign donor
        other = transport(key=OTHER)
        other.send_checkpoint([0], 4, STATE, timedelta(seconds=5))
        ts, nonce = f"{time.time():.3f}", "ef" * 16
        req = urllib.request.Request(other.metadata() + "4", headers={"Authorization": signed(OTHER, other.metadata() + "4", ts, nonce)})
        body = urllib.request.urlopen(req, timeout=5).read()
        other.shutdown()
    attacker = _Raw(body) if length == -1 else _Attacker(body, length)  # -1: this raw answer
    rx = transport(timeout=3)
    try:
        with caplog.at_level(logging.WARNING, logger="hier_localsgd.core.ft.heals"):
            with pytest.raises(HealRefused, match=why):
                rx.recv_checkpoint(0, attacker.metadata, 4, timedelta(seconds=3))
        assert sum("heal from" in r.getMessage() and "refused" in r.getMessage() for r in caplog.records) == 1
    finally:
        rx.shutdown()
        attacker.close()


class _Raw:
    """A socket server answering one request with ``answer`` (bytes, headers included)."""

    def __init__(self, answer: bytes) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.metadata = f"http://127.0.0.1:{self.sock.getsockname()[1]}/heal/"

        def serve():
            try:
                c, _ = self.sock.accept()
                c.recv(4096)
                c.sendall(answer)
                c.close()
            except OSError:
                pass

        threading.Thread(target=serve, daemon=True).start()

    def close(self):
        self.sock.close()


def test_a_donor_address_that_is_not_a_heal_url_is_refused():
    rx = transport()
    try:
        for bad in ("file:///etc/passwd", "http://127.0.0.1:1/checkpoint/", "http://a b:1/heal/", "ftp://x:1/heal/",
                    "http://127.0.0.1:99999/heal/", "http://127.0.0.1:1/heal/?x"):
            with pytest.raises(HealRefused, match="malformed donor address"):
                rx.recv_checkpoint(0, bad, 1, timedelta(seconds=1))
    finally:
        rx.shutdown()


def test_a_donor_serves_only_the_staged_step_and_only_until_disallowed():
    donor = transport(timeout=1)  # a request for a step not staged waits this long
    donor.send_checkpoint([1], 4, STATE, timedelta(seconds=5))
    rx = transport(timeout=3)
    try:
        with pytest.raises(HealRefused, match="409"):
            rx.recv_checkpoint(0, donor.metadata(), 5, timedelta(seconds=3))
        donor.disallow_checkpoint()
        with pytest.raises(HealRefused, match="409"):
            rx.recv_checkpoint(0, donor.metadata(), 4, timedelta(seconds=3))
        assert [r.split(" (")[0] for r in donor.refusals] == ["step 5 is not served here", "step 4 is not served here"]
    finally:
        rx.shutdown()
        donor.shutdown()


# -- a whole job -------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_jobs_listeners_bind_its_address_and_its_heals_are_authenticated(tmp_path):
    """A 2 x 2 job whose leader of cluster 1 is killed and restarted (it heals from its
    peer): every listening socket of every process of the job (lighthouses, stores,
    torchft's ManagerServers, heal servers, Gloo) binds an address, never every interface;
    the local launcher made the job a secret (owner-only) and the heal went through."""
    from harness import WAIT_FOR_RESTART, job_listeners, logs_tail, run_job, wildcard

    seen: dict = {}
    killed = {"done": False}

    def during(job) -> None:
        seen.update(job_listeners(job))
        status = job.status((1, 0)) or {}
        if not killed["done"] and status.get("step", 0) >= 10:
            killed["done"] = True
            job.kill((1, 0))

    # The others wait for the restart (a fresh interpreter: seconds of imports on a loaded
    # machine), or its peer may finish first and leave it nobody to heal from (CI of stop 38).
    run = run_job(tmp_path, ["train.steps=60", "train.min_step_time_s=0.1", *WAIT_FOR_RESTART, "sync.inner.every=5", "sync.outer.every=2"],
                  during=during, restart=True, timeout_s=300)
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    assert killed["done"]
    restarts = [h for h in run.job.history if h["event"] == "restart"]
    assert [h["key"] for h in restarts] == [(1, 0)], run.job.history
    heals = [e for e in run.kinds((1, 0), "heal") if e["t"] > restarts[0]["t"]]
    assert heals, "the restarted group healed from a peer"
    secret = tmp_path / "job.secret"
    assert secret.exists() and (secret.stat().st_mode & 0o777) == 0o600
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("c*.log"))
    assert "heals are not authenticated" not in logs  # every Manager had the job's heal key
    print("listeners:", sorted(seen))
    assert len(seen) >= 8, seen  # 3 lighthouses, and per group a store, a ManagerServer and a heal server per level
    assert not wildcard(seen), f"listeners on every interface: {wildcard(seen)}"
    text = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log"))
    assert secret.read_text().strip() not in text  # the secret never reaches a log


def test_a_hostname_that_resolves_to_loopback_with_remote_lighthouses_is_one_line_naming_it():
    """Debian maps the machine's name to 127.0.1.1: listeners would bind loopback while
    peers on other hosts are told to connect there. Refused at start unless run.bind says
    where to listen; a single-host job (loopback lighthouses) is not affected."""
    from hier_localsgd.config import load_config

    remote = ["lighthouse.global_addr=http://10.9.9.9:1", "lighthouse.cluster_addrs=[http://10.9.9.9:2,http://10.9.9.9:3]"]
    with pytest.raises(ConfigError, match=r"^run.hostname: 'localhost' resolves to 127.0.0.1 \(loopback\) but http://10.9.9.9:1 is on another host"):
        load_config([*remote, "run.hostname=localhost"], validate_for="train")
    assert load_config([*remote, "run.hostname=localhost", "run.bind=0.0.0.0"], validate_for="train").run.bind == "0.0.0.0"
    assert load_config([*remote, "run.hostname=10.0.0.5"], validate_for="train").run.hostname == "10.0.0.5"
    assert load_config(["run.hostname=localhost"], validate_for="train").run.hostname == "localhost"


@pytest.mark.parametrize("value", [1279, 65441, True, 0])
def test_a_tunnel_mtu_outside_its_range_is_one_line_naming_the_field(value):
    with pytest.raises(ConfigError, match=r"^security.tunnel_mtu: .* an integer in \[1280, 65440\]"):
        SecurityConfig(tunnel_mtu=value).check()
    SecurityConfig(tunnel_mtu=1280).check()
    SecurityConfig(tunnel_mtu=65440).check()
