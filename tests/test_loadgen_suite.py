"""Frozen suites built from local prompts with a local tokenizer; seeded Poisson arrivals."""

import json

import numpy as np
import pytest
from scipy import stats as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from loadgen.arrivals import declared_duration, poisson_arrivals
from loadgen.suite import Suite, SuiteError, SuiteRequest, build_suite, load_suite, pad_suite

PROMPTS = [
    {"id": "gsm8k:test:0", "prompt": "Natalia sold clips to 48 friends", "answer": "#### 72"},
    {"id": "gsm8k:test:1", "prompt": "Weng earns 12 an hour for babysitting", "answer": "#### 10"},
]


@pytest.fixture
def tokenizer_dir(tmp_path):
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [p["prompt"] for p in PROMPTS] + ["Betty is saving money for a new wallet"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    out = tmp_path / "tok"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    return out


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_build_suite_tokenizes_locally_and_round_trips_with_its_digest(tmp_path, tokenizer_dir):
    prompts = write_jsonl(tmp_path / "gsm8k.jsonl", PROMPTS)
    suite = build_suite(prompts, tokenizer_dir, name="gsm8k")
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert suite.ids == ["gsm8k:test:0", "gsm8k:test:1"]
    assert list(suite.requests[0].input_ids) == tok.encode(PROMPTS[0]["prompt"]).ids
    assert suite.requests[0].doc == {"answer": "#### 72"} and suite.requests[0].scored
    loaded = load_suite(suite.save(tmp_path / "suite.jsonl"), name="gsm8k")
    assert loaded.digest == suite.digest and loaded.requests == suite.requests


def test_padding_appends_unscored_load_and_changes_the_digest(tmp_path, tokenizer_dir):
    suite = build_suite(write_jsonl(tmp_path / "p.jsonl", PROMPTS), tokenizer_dir)
    extra = Suite("train", tuple(SuiteRequest(f"gsm8k:train:{i}", (1, 2, i + 3)) for i in range(5)))
    padded = pad_suite(suite, extra, 5)
    assert len(padded) == 5 and padded.ids[2:] == ["gsm8k:train:0", "gsm8k:train:1", "gsm8k:train:2"]
    assert [r.scored for r in padded.requests] == [True, True, False, False, False]
    assert padded.digest != suite.digest
    with pytest.raises(SuiteError, match="need 8 extra requests, suite 'train' offers 5"):
        pad_suite(suite, extra, 10)


def test_suite_errors_name_the_line_and_field(tmp_path, tokenizer_dir):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "input_ids": [1]}, {"id": "b", "input_ids": []}])
    with pytest.raises(SuiteError, match=r"bad.jsonl:2.input_ids"):
        load_suite(bad)
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "input_ids": [1]}, {"id": "a", "input_ids": [2]}])
    with pytest.raises(SuiteError, match="duplicate request id 'a'"):
        load_suite(dup)
    with pytest.raises(SuiteError, match=r"p.jsonl:1.prompt: required"):
        build_suite(write_jsonl(tmp_path / "p.jsonl", [{"id": "x"}]), tokenizer_dir)
    with pytest.raises(SuiteError, match="no tokenizer.json"):
        build_suite(tmp_path / "p.jsonl", tmp_path)


def test_poisson_arrivals_are_seeded_and_fill_the_declared_window():
    a = poisson_arrivals(2000, 10.0, seed=4)
    assert a == poisson_arrivals(2000, 10.0, seed=4) and a != poisson_arrivals(2000, 10.0, seed=5)
    assert declared_duration(2000, 10.0) == 200.0
    assert 0 <= a[0] and a[-1] < 200.0 and a == sorted(a)
    # a Poisson process: gaps are exponential with mean 1 / rate
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.1, rel=0.06)
    assert st.kstest(gaps, "expon", args=(0, 0.1)).pvalue > 0.01
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_arrivals(3, 0.0, 0)


def test_cli_builds_and_pads_a_suite(tmp_path, tokenizer_dir, capsys):
    from loadgen.cli import main as cli_main

    prompts = write_jsonl(tmp_path / "test.jsonl", PROMPTS)
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Betty is saving money"}] * 3)
    assert cli_main(["build-suite", "--prompts", str(prompts), "--tokenizer", str(tokenizer_dir), "--out",
                     str(tmp_path / "s.jsonl")]) == 0
    assert cli_main(["build-suite", "--prompts", str(train), "--tokenizer", str(tokenizer_dir), "--out",
                     str(tmp_path / "t.jsonl"), "--id-prefix", "gsm8k:train", "--unscored"]) == 0
    assert cli_main(["pad-suite", "--suite", str(tmp_path / "s.jsonl"), "--extra", str(tmp_path / "t.jsonl"),
                     "--size", "4", "--out", str(tmp_path / "p.jsonl")]) == 0
    padded = load_suite(tmp_path / "p.jsonl")
    assert padded.ids == ["gsm8k:test:0", "gsm8k:test:1", "gsm8k:train:0", "gsm8k:train:1"]
    assert cli_main(["pad-suite", "--suite", str(tmp_path / "s.jsonl"), "--extra", str(tmp_path / "t.jsonl"),
                     "--size", "9", "--out", str(tmp_path / "q.jsonl")]) == 2
    assert "need 7 extra requests" in capsys.readouterr().err


def test_loadgen_runs_without_torch(cli_env):
    """The loadgen image carries no torch: importing every loadgen module must not import it."""
    import subprocess
    import sys

    code = ("import sys, loadgen.cli, loadgen.experiment, loadgen.report, loadgen.simulate, loadgen.demo, "
            "loadgen.quality; sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], env=cli_env).returncode == 0
