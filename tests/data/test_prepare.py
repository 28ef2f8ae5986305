"""sppo-prepare: text files to token files, through main() and the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sppo.data import PackedSequences, TokenFile
from lightning_sppo.data.prepare import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def texts(tmp_path) -> Path:
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("Hello, world.\n")
    (folder / "b.txt").write_text("First paragraph\nstill first.\n\n  \nSecond — with a dash.\n\n\n")
    (folder / "empty.txt").write_text("\n\n")
    return folder


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("sppo-prepare: error: ")
    return err


def test_bytes_one_document_per_file(texts, tmp_path, capsys):
    assert main([str(texts / "a.txt"), str(texts / "b.txt"), "--output", str(tmp_path / "out" / "ab")]) == 0
    assert "wrote" in capsys.readouterr().out
    tf = TokenFile.open(tmp_path / "out" / "ab")
    assert (tf.vocab_size, tf.eos_id, tf.meta.tokenizer, tf.meta.dtype) == (256, None, "bytes", "uint16")
    assert bytes(tf.document(0).tolist()) == b"Hello, world.\n"
    assert bytes(tf.document(1).tolist()) == (texts / "b.txt").read_bytes()  # UTF-8 bytes, the dash is 3 ids
    assert int(tf.ids.max()) < 256


def test_directory_blank_lines_and_eos(texts, tmp_path, capsys):
    assert main([str(texts), "-o", str(tmp_path / "p"), "--split", "blank-lines", "--eos-id", "256"]) == 0
    assert "1 empty skipped" in capsys.readouterr().out
    tf = TokenFile.open(tmp_path / "p")
    assert (tf.vocab_size, tf.eos_id) == (257, 256)
    documents = [bytes(tf.document(i).tolist()).decode() for i in range(len(tf))]
    assert documents == ["Hello, world.", "First paragraph\nstill first.", "Second — with a dash."]
    ds = PackedSequences(tf, seq_len=8, packing=True)
    assert len(ds) == (sum(len(d.encode()) + 1 for d in documents) - 1) // 8


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.txt"], "input 'missing.txt' not found"),
        (["EMPTY_DIR"], "has no *.txt files"),
        (["texts/empty.txt"], "hold no text"),
        (["texts/latin1.txt"], "latin1.txt is not UTF-8 text: unexpected end of data at byte 3"),
        (["texts/a.txt", "--eos-id", "300"], "byte tokenizer takes eos_id in [0, 256], got eos_id=300"),
        (["texts/a.txt", "--eos-id", "44"], "contains the eos id 44 (document 0, token 5)"),  # 44 is ","
        (["texts/a.txt", "--tokenizer", "no/such/dir"], "Tokenizer directory 'no/such/dir' not found"),
    ],
)
def test_bad_input_prints_one_line_and_fails(texts, tmp_path, capsys, monkeypatch, args, message):
    (texts / "latin1.txt").write_bytes("abc\xe9".encode("latin-1"))
    (tmp_path / "EMPTY_DIR").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main([*args, "--output", "out/x"]) == 1
    assert message in _one_error_line(capsys)
    assert not (tmp_path / "out" / "x.json").exists()


def test_failure_keeps_the_previous_output(texts, tmp_path, capsys):
    assert main([str(texts / "a.txt"), "-o", str(tmp_path / "x")]) == 0
    before = (tmp_path / "x.bin").read_bytes()
    assert main([str(texts / "empty.txt"), "-o", str(tmp_path / "x")]) == 1
    assert (tmp_path / "x.bin").read_bytes() == before
    assert TokenFile.open(tmp_path / "x").num_tokens == len(before) // 2


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["a.txt"])  # no --output
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        main(["a.txt", "-o", "x", "--eos-id", "minus"])
    assert "expected a non-negative integer or 'none'" in capsys.readouterr().err


def test_missing_huggingface_library_is_one_line(tmp_path, capsys, monkeypatch, texts):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise ImportError
    assert main([str(texts / "a.txt"), "-o", str(tmp_path / "x"), "--tokenizer", str(tmp_path / "tok")]) == 1
    assert "needs the `tokenizers` package: pip install tokenizers" in _one_error_line(capsys)


def test_huggingface_tokenizer(tmp_path, texts, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, ",": 3, "world": 4, ".": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.normalizer = tokenizers.normalizers.Lowercase()
    tok.add_special_tokens(["</s>"])
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))

    assert main([str(texts / "a.txt"), "-o", str(tmp_path / "hf"), "--tokenizer", str(tmp_path / "tok")]) == 0
    tf = TokenFile.open(tmp_path / "hf")
    assert (tf.vocab_size, tf.eos_id, tf.ids.tolist()) == (6, 1, [2, 3, 4, 5])
    assert tf.meta.tokenizer.startswith("huggingface:")
    assert (
        main(
            [str(texts / "a.txt"), "-o", str(tmp_path / "hf"), "--tokenizer", str(tmp_path / "tok"), "--eos-id", "none"]
        )
        == 0
    )
    assert TokenFile.open(tmp_path / "hf").eos_id is None


def _console_script() -> str:
    script = shutil.which("sppo-prepare", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the sppo-prepare console script is not installed (pip install -e .)")
    return script


def test_console_script(texts, tmp_path):
    script = _console_script()
    ok = subprocess.run([script, str(texts), "--output", str(tmp_path / "c")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert TokenFile.open(tmp_path / "c").num_documents == 2
    bad = subprocess.run(
        [script, str(tmp_path / "missing.txt"), "--output", str(tmp_path / "d")], capture_output=True, text=True
    )
    assert bad.returncode == 1
    assert bad.stderr.splitlines() == [f"sppo-prepare: error: input {str(tmp_path / 'missing.txt')!r} not found"]


def test_shipped_demo_is_the_prepared_corpus(tmp_path, capsys):
    demo = TokenFile.open(ROOT / "data" / "demo")
    assert (demo.vocab_size, demo.eos_id, demo.meta.tokenizer) == (256, None, "bytes")
    corpus = sorted((ROOT / "data" / "corpus").glob("*.txt"))
    assert demo.num_documents == len(corpus) >= 3
    assert 50_000 <= demo.num_tokens <= 150_000
    # Regenerate with the command in data/README.md and compare byte for byte.
    assert main([str(ROOT / "data" / "corpus"), "--output", str(tmp_path / "demo")]) == 0
    for suffix in (".bin", ".idx", ".json"):
        assert (tmp_path / f"demo{suffix}").read_bytes() == (ROOT / "data" / f"demo{suffix}").read_bytes(), suffix
