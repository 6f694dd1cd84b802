"""Bad input gets one clear line naming the field, before anything starts (issue #11 §6).

Each bad data file goes through the real CLI (``hier-localsgd demo``): exit code 2, one
line on stderr naming the field and its value, no traceback, and no run directory (no
lighthouse, no worker, no log was started). A failure inside a started ``train``
process (an unreachable lighthouse) is one console line too, its traceback in the log.
"""

import os
import shutil
import socket
import subprocess
import sys

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hier_localsgd.config import load_config
from hier_localsgd.train.data import CHECK_PREFIX_BYTES, ByteTextData, check_input, min_tokens

TEXT = "".join(f"line {i}: the quick brown fox — jumps over the lazy dog\n" for i in range(200))


def cli(*args, prefix=(), env=None):
    return subprocess.run([*prefix, sys.executable, "-m", "hier_localsgd", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def demo(tmp_path, *overrides, prefix=()):
    run_dir = tmp_path / "run"
    p = cli("demo", "model=tiny", f"run.dir={run_dir}", "demo.dashboard=false", *overrides, prefix=prefix)
    return p, run_dir


def assert_one_line_before_anything_started(p, run_dir, field, value, words):
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"hier-localsgd demo: configuration error: {field}={value!r}: "), lines[0]
    assert words in lines[0], lines[0]
    assert "Traceback" not in p.stderr
    assert p.stdout == ""
    assert not run_dir.exists()  # no logs/, replicas/ or lighthouse: nothing was started


def write_bad(tmp_path, case):
    """(kind, path) of one bad input."""
    if case == "missing":
        return "text", tmp_path / "nope.txt"
    if case == "directory":
        (tmp_path / "corpus").mkdir()
        return "text", tmp_path / "corpus"
    path = tmp_path / ("bad.parquet" if case.startswith("parquet") else "bad.txt")
    if case == "empty":
        path.write_bytes(b"")
    elif case == "binary":  # invalid UTF-8, as an image or archive would be
        path.write_bytes(bytes(range(256)[::-1]) * 40)
    elif case == "nul_bytes":  # valid UTF-8 but NUL bytes: binary data, not text
        path.write_bytes(b"header\x00\x01\x02" * 1000)
    elif case == "utf16":
        path.write_bytes(TEXT.encode("utf-16"))
    elif case == "too_short":
        path.write_text("just a few words\n", encoding="utf-8")
    elif case == "parquet_not_parquet":
        path.write_text(TEXT, encoding="utf-8")
    elif case == "parquet_no_rows":
        pd.DataFrame({"text": pd.Series([], dtype=str)}).to_parquet(path)
    elif case == "parquet_empty_first_row_group":  # the datasets loader fails on it
        t = pa.table({"text": TEXT.splitlines()})
        with pq.ParquetWriter(path, t.schema) as w:
            w.write_table(t.slice(0, 0))
            w.write_table(t)
    elif case == "parquet_too_short":
        pd.DataFrame({"text": ["hi", "there"]}).to_parquet(path)
    return ("parquet" if case.startswith("parquet") else "text"), path


@pytest.mark.parametrize(
    "case, words",
    [
        pytest.param("missing", "no such file", id="missing"),
        pytest.param("directory", "is a directory", id="directory"),
        pytest.param("empty", "empty file (0 bytes)", id="empty"),
        pytest.param("binary", "not UTF-8 text (byte 0xff at offset 0 is invalid)", id="binary"),
        pytest.param("nul_bytes", "not text (a NUL byte at offset 6", id="nul_bytes"),
        pytest.param("utf16", "not UTF-8 text", id="utf16"),
        pytest.param("too_short", "too short: 16 tokens (UTF-8 bytes), needs at least 325 (one sequence of train.seq_len+1=65", id="too_short"),
        pytest.param("parquet_not_parquet", "not a parquet file", id="parquet_not_parquet"),
        pytest.param("parquet_no_rows", "no rows", id="parquet_no_rows"),
        pytest.param("parquet_empty_first_row_group", "first row group is empty", id="parquet_empty_first_row_group"),
        pytest.param("parquet_too_short", "too short: 8 tokens", id="parquet_too_short"),
    ],
)
def test_bad_data_file_is_one_line_naming_data_path(tmp_path, case, words):
    kind, path = write_bad(tmp_path, case)
    p, run_dir = demo(tmp_path, f"data={kind}", f"data.path={path}")
    assert_one_line_before_anything_started(p, run_dir, "data.path", str(path), words)


def test_unset_data_path_is_named(tmp_path):
    p, run_dir = demo(tmp_path, "data=text")
    assert_one_line_before_anything_started(p, run_dir, "data.path", "", "required for data.kind=text")


def test_parquet_without_the_column_names_data_text_column_and_the_columns(tmp_path):
    path = tmp_path / "corpus.parquet"
    pd.DataFrame({"body": TEXT.splitlines(), "id": range(200)}).to_parquet(path)
    p, run_dir = demo(tmp_path, "data=parquet", f"data.path={path}")
    assert_one_line_before_anything_started(p, run_dir, "data.text_column", "text", f"not a column of {str(path)!r}")
    assert "['body', 'id']" in p.stderr


def test_unreadable_file_is_named(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text(TEXT, encoding="utf-8")
    path.chmod(0)
    prefix = ()
    if os.geteuid() == 0:
        # root reads a mode-000 file; without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH it cannot
        setpriv = shutil.which("setpriv")
        prefix = (setpriv, "--bounding-set", "-dac_override,-dac_read_search")
        if setpriv is None or subprocess.run([*prefix, "cat", str(path)], capture_output=True).returncode == 0:
            pytest.skip("running as root and cannot drop CAP_DAC_OVERRIDE here, so no file is unreadable")
    p, run_dir = demo(tmp_path, "data=text", f"data.path={path}", prefix=prefix)
    assert_one_line_before_anything_started(p, run_dir, "data.path", str(path), "cannot be read (PermissionError: Permission denied)")


def test_valid_text_and_parquet_files_pass_validation(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT, encoding="utf-8")
    parquet = tmp_path / "corpus.parquet"
    pd.DataFrame({"body": TEXT.splitlines()}).to_parquet(parquet)
    for over in (["data=text", f"data.path={text}"], ["data=parquet", f"data.path={parquet}", "data.text_column=body"]):
        p, run_dir = demo(tmp_path, *over, "--print-config")
        assert p.returncode == 0, p.stderr
        assert p.stderr == "" and f"path: {over[1].split('=', 1)[1]}" in p.stdout
        assert not run_dir.exists()


def test_only_commands_that_train_check_the_file(tmp_path):
    over = ["model=tiny", "data=text", f"data.path={tmp_path / 'nope.txt'}"]
    load_config(over, validate_for="lighthouse")  # a lighthouse host need not hold the corpus
    for command in ("train", "demo", "chaos", "sweep", "bench"):
        with pytest.raises(ValueError, match=r"^data.path='.*nope.txt': no such file$"):
            load_config(over, validate_for=command)


def _with_tokens(n, style):
    """The bytes of a text file whose loaded corpus has exactly ``n`` tokens (multi-byte characters included)."""
    k = (n - 1) // 9
    text = "éé abc\n" * k + "x" * (n - 9 * k)  # 9 bytes a line; ends without a newline
    assert len(text.encode()) == n
    if style == "crlf":
        return (text.replace("\n", "\r\n") + "\r\n").encode()
    return (text + ("\n" if style == "lf" else "")).encode()


@pytest.mark.parametrize("style", ["lf", "crlf", "no_final_newline"])
def test_the_check_counts_tokens_exactly_as_the_loader_does(tmp_path, style):
    cfg = load_config(["model=tiny"])
    d = cfg.data
    d.kind, d.eval_fraction = "text", 0.05
    need = min_tokens(cfg.train.seq_len, cfg.num_shards, d.eval_fraction)
    for n in (need, need - 1):
        path = tmp_path / f"corpus{n}.txt"
        path.write_bytes(_with_tokens(n, style))
        d.path = str(path)

        def load():
            return ByteTextData(d.path, "text", "text", 0, 0, cfg.num_shards, 2, cfg.train.seq_len, 1, d.eval_fraction)

        if n == need:
            check_input(d, cfg.train.seq_len, cfg.num_shards)
            load()
        else:
            with pytest.raises(ValueError, match=f"too short: {n} tokens"):
                check_input(d, cfg.train.seq_len, cfg.num_shards)
            with pytest.raises(ValueError, match=f"{n} tokens is too short"):
                load()


def test_a_large_file_is_checked_by_its_prefix_and_the_loader_names_a_late_bad_byte(tmp_path):
    cfg = load_config(["model=tiny"])
    d = cfg.data
    d.kind = "text"
    sparse = tmp_path / "huge.txt"
    with open(sparse, "wb") as f:
        f.write(TEXT.encode() * (2 * CHECK_PREFIX_BYTES // len(TEXT.encode())))
        f.truncate(8 << 30)  # 8 GiB, a hole of NUL bytes past the prefix: never read
    d.path = str(sparse)
    check_input(d, cfg.train.seq_len, cfg.num_shards)

    late = tmp_path / "late.txt"
    late.write_bytes(TEXT.encode() * (2 * CHECK_PREFIX_BYTES // len(TEXT.encode())) + b"\xff\n")
    d.path = str(late)
    check_input(d, cfg.train.seq_len, cfg.num_shards)  # the bad byte lies past the prefix
    with pytest.raises(ValueError, match=r"^data.path='.*late.txt': the datasets loader failed: UnicodeDecodeError"):
        ByteTextData(d.path, "text", "text", 0, 0, 1, 2, cfg.train.seq_len, 1, d.eval_fraction)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_with_unreachable_lighthouse(tmp_path, env=None):
    addr = f"http://127.0.0.1:{_closed_port()}"
    p = cli("train", "model=tiny", "sync.mode=flat", f"run.dir={tmp_path}", f"lighthouse.global_addr={addr}",
            "run.cluster=0", "run.replica=0", "timeouts.connect=1", env=env)
    return p, addr


def test_unreachable_lighthouse_is_one_console_line_with_the_traceback_in_the_log(tmp_path):
    p, addr = _train_with_unreachable_lighthouse(tmp_path)
    assert p.returncode == 1, p.stderr  # a runtime failure, not a configuration error (runbook: exit codes)
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert f"lighthouse.global_addr={addr}: lighthouse unreachable" in lines[0]
    log = tmp_path / "logs" / "c0r0.log"
    assert lines[0].endswith(f"(details in {log})")
    assert "Traceback" not in p.stderr
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "LighthouseUnreachable" in text


def test_debug_env_shows_the_traceback_on_the_console(tmp_path):
    p, addr = _train_with_unreachable_lighthouse(tmp_path, env=dict(os.environ, HIER_LOCALSGD_DEBUG="1"))
    assert p.returncode == 1
    assert f"lighthouse.global_addr={addr}: lighthouse unreachable" in p.stderr
    assert "Traceback (most recent call last)" in p.stderr
    assert "Traceback (most recent call last)" in (tmp_path / "logs" / "c0r0.log").read_text()


@pytest.mark.parametrize("command", ["train", "demo"])
def test_a_run_dir_that_is_a_file_is_one_line(tmp_path, command):
    (tmp_path / "afile").write_text("not a directory")
    for bad, words in ((tmp_path / "afile", " is a file, not a directory"), (tmp_path / "afile" / "run", ": a part of it is a file, not a directory")):
        p = cli(command, "model=tiny", f"run.dir={bad}", "demo.dashboard=false")
        assert p.returncode == 2, p.stderr
        assert p.stderr.splitlines() == [f"hier-localsgd {command}: configuration error: run.dir: {str(bad)!r}{words}"], p.stderr


def test_a_run_dir_that_cannot_be_created_is_one_line(tmp_path):
    p = cli("demo", "model=tiny", "run.dir=/proc/no-such-dir/run", "demo.dashboard=false")
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == ["hier-localsgd demo: configuration error: run.dir: cannot create '/proc/no-such-dir/run': No such file or directory"]


def test_a_demo_whose_lighthouse_port_is_taken_starts_nothing(tmp_path):
    """demo.free_ports=false with a foreign listener on the global lighthouse's port: before,
    the launcher's probe took that listener for its lighthouse, started every group, then
    failed with a traceback. Now one line naming the field, and nothing started."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p, run_dir = demo(tmp_path, "demo.free_ports=false", f"lighthouse.global_addr=http://127.0.0.1:{port}",
                          "lighthouse.cluster_addrs=[http://127.0.0.1:1,http://127.0.0.1:2]")
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [
        f"hier-localsgd demo: configuration error: lighthouse.global_addr: http://127.0.0.1:{port}: port {port} is already in use "
        "(another process listens there); free it, or let the launcher pick free ports (demo.free_ports=true)"], p.stderr
    assert not list((run_dir / "logs").glob("c*r*.log"))  # no replica group was started
