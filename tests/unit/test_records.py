"""Records: the contract's checks, and the append-only file surviving crashes and bad lines."""

import base64
import json

import numpy as np
import pytest
from _synthetic import SyntheticExecution, Thread

from gyre.records import CallRecord, RecordError, RecordFileError, RecordWriter, VersionSpan, read_records


def _conversation(n_turns=6, execution_id="ex"):
    ex = SyntheticExecution(execution_id, seed=3)
    main = Thread(ex, "main", None, ex.context(200))
    sub = Thread(ex, "sa", "main", ex.context(150))
    for k in range(n_turns):
        main.turn(30, 90, split_version=(k == 2))
        sub.turn(20, 80)
    return ex.records


def _same(a: CallRecord, b: CallRecord) -> bool:
    return (
        all(
            getattr(a, k) == getattr(b, k)
            for k in (
                "execution_id",
                "call_id",
                "seq",
                "agent_id",
                "parent_agent_id",
                "kind_hint",
                "version_spans",
                "finish_reason",
                "hints",
                "started_at",
                "is_retry",
            )
        )
        and np.array_equal(a.input_ids, b.input_ids)
        and np.array_equal(a.output_ids, b.output_ids)
        and np.array_equal(a.logprobs, b.logprobs)
    )


def test_roundtrip_keeps_every_field_and_stores_inputs_as_deltas(tmp_path):
    records = _conversation()
    path = tmp_path / "ex.jsonl"
    with RecordWriter(path) as w:
        for r in records:
            w.append(r)
    back, stats = read_records(path)
    assert stats.num_torn == 0 and stats.invalid == [] and stats.num_read == len(records)
    assert all(_same(a, b) for a, b in zip(records, back))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["input_base"] for x in lines[:2]] == [None, None]
    assert all(x["input_base"] is not None for x in lines[2:])  # later turns extend the same agent's context
    assert stats.num_bytes < 4 * 2 * sum(r.num_tokens for r in records)


def test_a_reopened_writer_continues_the_deltas(tmp_path):
    records = _conversation()
    path = tmp_path / "ex.jsonl"
    with RecordWriter(path) as w:
        for r in records[:2]:
            w.append(r)
    with RecordWriter(path) as w:  # a new process: without continue_from, record 2 would be stored whole
        w.continue_from(read_records(path)[0])
        for r in records[2:]:
            w.append(r)
    back, stats = read_records(path)
    assert stats.num_read == len(records) and all(_same(a, b) for a, b in zip(records, back))
    assert all(json.loads(x)["input_base"] is not None for x in path.read_text().splitlines()[2:])


@pytest.mark.parametrize("cut", [1, 7, 40, -2], ids=["one-byte", "mid-json", "mid-tokens", "all-but-newline"])
def test_torn_last_line_is_skipped_and_counted_nothing_else_lost(tmp_path, cut):
    records = _conversation()
    path = tmp_path / "ex.jsonl"
    with RecordWriter(path, fsync=False) as w:
        for r in records:
            w.append(r)
    data = path.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    end = last_start + cut if cut > 0 else len(data) + cut + 1
    path.write_bytes(data[:end])
    back, stats = read_records(path)
    complete = cut < 0  # everything but the newline: the record itself is whole
    assert stats.num_torn == (0 if complete else 1)
    assert len(back) == len(records) - (0 if complete else 1)
    assert all(_same(a, b) for a, b in zip(records, back))


@pytest.mark.parametrize(
    "tail", [b'{"v": 1, "call_id": "half', b"\0" * 300 + b"\n"], ids=["half-line", "zero-filled-line"]
)
def test_writer_reopening_a_torn_file_cuts_the_tail_then_appends(tmp_path, tail):
    """A crash leaves half a line, or (power loss before the data blocks) zeros up to a newline."""
    records = _conversation()
    path = tmp_path / "ex.jsonl"
    with RecordWriter(path, fsync=False) as w:
        for r in records[:-1]:
            w.append(r)
    with open(path, "ab") as f:
        f.write(tail)
    with RecordWriter(path, fsync=False) as w:
        assert w.num_truncated_bytes > 0
        w.append(records[-1])
    back, stats = read_records(path)
    assert stats.num_torn == 0 and len(back) == len(records)
    assert _same(back[-1], records[-1])


def test_corrupt_middle_line_is_a_clear_error(tmp_path):
    path = tmp_path / "ex.jsonl"
    with RecordWriter(path, fsync=False) as w:
        for r in _conversation():
            w.append(r)
    lines = path.read_bytes().split(b"\n")
    lines[3] = lines[3][:50]
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(RecordFileError, match="line 4 .*only the last line can be torn"):
        read_records(path)


def test_invalid_complete_record_is_a_counted_exclusion(tmp_path):
    records = _conversation(n_turns=3)
    path = tmp_path / "ex.jsonl"
    with RecordWriter(path, fsync=False) as w:
        for r in records:
            w.append(r)
    lines = path.read_text().splitlines()
    bad = json.loads(lines[1])
    short = base64.b64decode(bad["logprobs"])[:-8]  # 2 float32 log-probs short
    bad["logprobs"] = base64.b64encode(short).decode()
    lines[1] = json.dumps(bad)
    path.write_text("\n".join(lines) + "\n")
    back, stats = read_records(path)
    assert [n for n, _ in stats.invalid] == [2]
    assert "logprobs for" in stats.invalid[0][1]
    assert [r.call_id for r in back] == [r.call_id for r in records if r.call_id != records[1].call_id]


def test_writer_refuses_another_execution(tmp_path):
    a = _conversation(1, "ex-a")[0]
    b = _conversation(1, "ex-b")[0]
    with RecordWriter(tmp_path / "a.jsonl", fsync=False) as w:
        w.append(a)
        with pytest.raises(RecordError, match="holds execution 'ex-a'"):
            w.append(b)


def _kw(**over):
    kw = dict(
        execution_id="e",
        call_id="c",
        seq=0,
        agent_id="main",
        parent_agent_id=None,
        kind_hint="main",
        input_ids=np.arange(5, dtype=np.int32),
        output_ids=np.arange(3, dtype=np.int32),
        logprobs=np.full(3, -0.5, np.float32),
        version_spans=(VersionSpan(0, 3, 1),),
        finish_reason="stop",
    )
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(logprobs=np.full(2, -0.5, np.float32)), "2 logprobs for 3 output tokens"),
        (dict(logprobs=np.array([-1, 0.5, -1], np.float32)), "finite and <= 0"),
        (dict(input_ids=np.arange(5, dtype=np.int64)), "input_ids must be a 1-D int32"),
        (dict(input_ids=np.zeros(0, np.int32)), "input_ids is empty"),
        (dict(version_spans=(VersionSpan(0, 2, 1),)), "cover 2 of 3"),
        (dict(version_spans=(VersionSpan(0, 2, 1), VersionSpan(1, 3, 2))), "tile"),
        (dict(kind_hint="title"), "kind_hint 'title' is not one of main, summary"),
        (dict(finish_reason="eos"), "finish_reason 'eos'"),
        (dict(agent_id="sa1"), "only the main agent has no parent"),
        (dict(hints={"header": object()}), "hints must be JSON-serialisable"),
    ],
    ids=[
        "short-logprobs",
        "positive-logprob",
        "int64",
        "empty-input",
        "short-spans",
        "overlap-spans",
        "bad-kind",
        "bad-finish",
        "orphan-subagent",
        "hints-not-json",
    ],
)
def test_record_contract_violations_name_the_problem(over, match):
    with pytest.raises(RecordError, match=match):
        CallRecord(**_kw(**over))


def test_output_versions_expand_spans():
    r = CallRecord(**_kw(version_spans=(VersionSpan(0, 1, 4), VersionSpan(1, 3, 5))))
    assert r.output_versions().tolist() == [4, 5, 5]


def test_build_from_plain_sequences_as_a_proxy_would():
    r = CallRecord.build(
        execution_id="e",
        call_id="rid-1",
        seq=0,
        agent_id="main",
        parent_agent_id=None,
        kind_hint="unknown",
        input_ids=[5, 6, 7],
        output_ids=[8, 9, 10, 11],
        logprobs=[-0.1, -0.2, -0.3, -0.4],
        versions=[3, 3, 4, 4],
        finish_reason="length",
        hints={"x-claude-code-agent-id": None},
    )
    assert r.input_ids.dtype == np.int32 and r.logprobs.dtype == np.float32
    assert r.version_spans == (VersionSpan(0, 2, 3), VersionSpan(2, 4, 4))
    fields = {k: v for k, v in _kw().items() if k not in ("input_ids", "output_ids", "logprobs", "version_spans")}
    with pytest.raises(RecordError, match="cover 3 of 4"):
        CallRecord.build(**fields, input_ids=[1], output_ids=[1, 2, 3, 4], logprobs=[-1.0] * 4, versions=[1, 1, 1])


def test_concurrent_appends_from_threads_stay_whole_lines(tmp_path):
    """The proxy may append from an executor thread per request: lines must never interleave."""
    from concurrent.futures import ThreadPoolExecutor

    records = _conversation(n_turns=20)
    path = tmp_path / "ex.jsonl"
    with RecordWriter(path, fsync=False) as w, ThreadPoolExecutor(4) as pool:
        list(pool.map(w.append, records))
    back, stats = read_records(path)
    assert stats.num_torn == 0 and not stats.invalid
    assert sorted(r.call_id for r in back) == sorted(r.call_id for r in records)
    by_id = {r.call_id: r for r in records}
    assert all(_same(b, by_id[b.call_id]) for b in back)


def _wait_for(cond, timeout_s=10.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_group_commit_writes_at_once_and_fsyncs_in_batches(tmp_path, monkeypatch):
    """A line is in the file when append returns (a killed process loses nothing answered); the
    fsync comes later from the group commit, once per batch of files, and close flushes the rest."""
    import os

    from gyre.records.io import GroupCommit

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    records = _conversation(n_turns=3)
    group = GroupCommit(window_s=0.05)
    writers = [RecordWriter(tmp_path / f"{i}.jsonl", group=group) for i in range(3)]
    synced.clear()  # the directory fsyncs of the new files
    for w in writers:
        w.append(records[0])
        assert len(read_records(w.path)[0]) == 1  # readable before any fsync
    _wait_for(lambda: group.num_syncs == 3)
    assert len(synced) == 3 and group.num_errors == 0
    slow = GroupCommit(window_s=60)
    with RecordWriter(tmp_path / "slow.jsonl", group=slow) as w:
        w.append(records[0])
        w.append(records[1])
        slow.close()  # does not wait for the window: fsyncs what is pending, once
        assert slow.num_syncs == 1 and slow.num_batches == 1
    group.close()
    for w in writers:
        w.close()


def test_group_commit_retries_a_failed_fsync(tmp_path, monkeypatch):
    import os

    from gyre.records.io import GroupCommit

    real_fsync, failures = os.fsync, []
    monkeypatch.setattr(
        os, "fsync", lambda fd: real_fsync(fd) if not failures else (_ for _ in ()).throw(failures.pop())
    )
    group = GroupCommit(window_s=0.01)
    with RecordWriter(tmp_path / "a.jsonl", group=group) as w:
        failures.append(OSError(5, "Input/output error"))
        w.append(_conversation(n_turns=1)[0])
        _wait_for(lambda: group.num_syncs == 2)  # the failed one, then its retry in the next batch
        assert group.num_errors == 1 and not w._unsynced
    group.close()


def test_a_failed_write_is_cut_off_so_the_file_stays_readable(tmp_path, monkeypatch):
    """A write the disk refuses halfway (ENOSPC) must not leave a torn line before later records."""
    import os

    records = _conversation(n_turns=3)
    path = tmp_path / "ex.jsonl"
    real_write = os.write
    with RecordWriter(path, fsync=False) as w:
        w.append(records[0])

        def half_then_full(fd, data):
            monkeypatch.setattr(
                os, "write", lambda fd, data: (_ for _ in ()).throw(OSError(28, "No space left on device"))
            )
            return real_write(fd, bytes(data[: len(data) // 2]))

        monkeypatch.setattr(os, "write", half_then_full)
        with pytest.raises(OSError, match="No space"):
            w.append(records[1])
        monkeypatch.setattr(os, "write", real_write)
        w.append(records[2])
    back, stats = read_records(path)
    assert stats.num_torn == 0 and not stats.invalid
    assert [r.call_id for r in back] == [records[0].call_id, records[2].call_id]
