"""sppo-prepare: text files to token files, through main() and the installed console script."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sppo.data import PackedSequences, TokenFile
from lightning_sppo.data.prepare import main
from tests import preloaded
from tests.subprocesses import one_thread_env

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
        (["missing.txt"], "INPUT 'missing.txt' not found"),
        (["EMPTY_DIR"], "has no *.txt, *.jsonl, *.parquet files"),
        (["texts/empty.txt"], "INPUT texts/empty.txt holds no text"),  # named (issue 39)
        (["texts/latin1.txt"], "latin1.txt is not UTF-8 text: unexpected end of data at byte 3"),
        (["texts/a.txt", "--eos-id", "300"], "byte tokenizer takes --eos-id in [0, 256], got --eos-id=300"),
        (["texts/a.txt", "--eos-id", "44"], "contains the eos id 44 (document 0, token 5)"),  # 44 is ","
        (["texts/a.txt", "--tokenizer", "no/such/dir"], "Tokenizer directory 'no/such/dir' not found"),
    ],
)
def test_bad_input_prints_one_line_and_fails(texts, tmp_path, capsys, monkeypatch, args, message):
    (texts / "latin1.txt").write_bytes("abc\xe9".encode("latin-1"))
    (tmp_path / "EMPTY_DIR").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main([*args, "--output", "out/x"]) == 2
    assert message in _one_error_line(capsys)
    assert not (tmp_path / "out" / "x.json").exists()


def test_failure_keeps_the_previous_output(texts, tmp_path, capsys):
    assert main([str(texts / "a.txt"), "-o", str(tmp_path / "x")]) == 0
    before = (tmp_path / "x.bin").read_bytes()
    assert main([str(texts / "empty.txt"), "-o", str(tmp_path / "x")]) == 2
    assert (tmp_path / "x.bin").read_bytes() == before
    assert TokenFile.open(tmp_path / "x").num_tokens == len(before) // 2


def test_usage_errors_exit_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["a.txt"])  # no --output
    assert exit_info.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["a.txt", "-o", "x", "--eos-id", "minus"])
    err = capsys.readouterr().err
    assert "expected a non-negative integer or 'none'" in err and err.count("\n") == 1, err  # one line, no usage
    (tmp_path / "afile").write_text("x")
    assert main([str(tmp_path), "-o", str(tmp_path / "afile" / "tokens")]) == 2  # was [Errno 17] File exists
    line = _one_error_line(capsys)
    assert "--output=" in line and f"'{tmp_path / 'afile'}' is a file, not a folder" in line


def test_missing_huggingface_library_is_one_line(tmp_path, capsys, monkeypatch, texts):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise ImportError
    assert main([str(texts / "a.txt"), "-o", str(tmp_path / "x"), "--tokenizer", str(tmp_path / "tok")]) == 2
    assert "needs the `tokenizers` package: pip install tokenizers" in _one_error_line(capsys)


def test_huggingface_tokenizer(tmp_path, texts, capsys):
    import tokenizers  # the dev extra installs it: a missing package fails here, never skips

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
            + ["--replace"]
        )
        == 0
    )
    assert TokenFile.open(tmp_path / "hf").eos_id is None


def _tokenizer_with_code(folder: Path, marker: Path) -> Path:
    """A tokenizer folder without tokenizer.json whose tokenizer_config.json names a class in its own Python file
    (``auto_map``, as Hub repositories with custom code do); importing that file creates ``marker``."""
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_own.OwnTokenizer", None]}})
    )
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenization_own.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PreTrainedTokenizer\nclass OwnTokenizer(PreTrainedTokenizer):\n    pass\n"
    )
    return folder


def test_a_tokenizer_folder_with_its_own_code_is_refused_without_asking_to_run_it(tmp_path, texts, capsys, monkeypatch):
    """transformers, left to decide (``trust_remote_code`` unset), asks on the terminal whether to run a folder's own
    tokenizer code: answered yes, it runs. ``--tokenizer`` never runs it and never asks (one line, exit status 2)."""
    import transformers  # the dev extra installs it: a missing package fails here, never skips

    marker = tmp_path / "CODE-RAN"
    folder = _tokenizer_with_code(tmp_path / "tok", marker)
    asked: list[str] = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")  # a user who says yes
    assert main([str(texts / "a.txt"), "-o", str(tmp_path / "x"), "--tokenizer", str(folder)]) == 2
    line = _one_error_line(capsys)
    assert "names Python code of its own (auto_map), which is never run" in line, line
    assert not asked and not marker.exists()
    with contextlib.suppress(NotImplementedError):  # the negative control: loaded as before, the yes runs the code
        transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)  # (a stub class: it fails)
    assert asked and marker.exists()


def _documents(path) -> list[str]:
    tf = TokenFile.open(path)
    return [bytes(tf.document(i).tolist()).decode() for i in range(len(tf))]


def test_jsonl_records_are_documents(tmp_path, capsys):
    records = [{"text": "first record", "id": 1}, {"text": None}, {"text": "   "}, {"text": "second — dash"}]
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    (tmp_path / "d.jsonl").write_text("\n".join([lines[0], "", *lines[1:]]) + "\n")  # a blank line is skipped
    assert main([str(tmp_path / "d.jsonl"), "-o", str(tmp_path / "out")]) == 0
    assert "3 texts, 1 empty skipped" in capsys.readouterr().out  # the null is no text, "   " an empty one
    assert _documents(tmp_path / "out") == ["first record", "second — dash"]


def test_jsonl_with_a_custom_text_field(tmp_path):
    rows = [{"content": "alpha", "text": "not this"}, {"content": "beta"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(tmp_path / "d.jsonl"), "-o", str(tmp_path / "out"), "--text-field", "content"]) == 0
    assert _documents(tmp_path / "out") == ["alpha", "beta"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"body": "x"}',
            "d.jsonl:2 has no 'text' field (it has ['body']); name the field holding the text with --text-field",
        ),
        ("{oops", "d.jsonl:2 is not a JSON object: Expecting property name enclosed in double quotes at column 2"),
        ('{"text": 7}', "d.jsonl:2: --text-field='text' holds int, not a string"),
        ('["text"]', "d.jsonl:2 has no 'text' field (it has list)"),
    ],
)
def test_bad_jsonl_names_the_line(tmp_path, capsys, line, message):
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    assert main([str(tmp_path / "d.jsonl"), "-o", str(tmp_path / "out")]) == 2
    assert message in _one_error_line(capsys)
    assert not (tmp_path / "out.json").exists()


def test_parquet_rows_are_documents(tmp_path):
    import pyarrow as pa  # the dev extra installs it: a missing package fails here, never skips
    import pyarrow.parquet as pq

    table = pa.table({"body": ["row zero", None, "row two"], "n": [0, 1, 2]})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)  # two row groups
    assert main([str(tmp_path / "d.parquet"), "-o", str(tmp_path / "out"), "--text-field", "body"]) == 0
    assert _documents(tmp_path / "out") == ["row zero", "row two"]
    assert main([str(tmp_path / "d.parquet"), "-o", str(tmp_path / "x")]) == 2  # no "text" column


def test_parquet_without_pyarrow_names_the_extra(tmp_path, capsys, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow.parquet` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert main([str(tmp_path / "d.parquet"), "-o", str(tmp_path / "out")]) == 2
    assert 'needs pyarrow: pip install "lightning-sppo[parquet]"' in _one_error_line(capsys)


def test_directory_reads_every_format_in_sorted_order(tmp_path):
    import pyarrow as pa  # the dev extra installs it: a missing package fails here, never skips
    import pyarrow.parquet as pq

    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.jsonl").write_text('{"text": "from jsonl"}\n')
    (folder / "a.txt").write_text("from txt")
    pq.write_table(pa.table({"text": ["from parquet"]}), folder / "sub" / "c.parquet")
    (folder / "notes.md").write_text("not an input")
    assert main([str(folder), "-o", str(tmp_path / "out")]) == 0
    assert _documents(tmp_path / "out") == ["from txt", "from jsonl", "from parquet"]


def _corpus(folder: Path) -> Path:
    folder.mkdir()
    for k in range(5):
        records = [{"text": f"document {k}.{j} " + "word " * (j % 7) + "\n\nsecond block"} for j in range(40)]
        (folder / f"part{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "story.txt").write_text("A story.\n\nIts second paragraph.")
    return folder


def _files(name: Path) -> list[bytes]:
    return [(name.parent / (name.name + suffix)).read_bytes() for suffix in (".bin", ".idx", ".json")]


@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
def test_parallel_workers_write_the_serial_file_byte_for_byte(tmp_path, tokenizer):
    folder = _corpus(tmp_path / "corpus")
    options = ["--split", "blank-lines"]
    if tokenizer == "hf":
        options += ["--tokenizer", str(_word_tokenizer(tmp_path))]
    assert main([str(folder), "-o", str(tmp_path / "serial"), *options, "--batch-size", "7"]) == 0  # the last short
    assert main([str(folder), "-o", str(tmp_path / "parallel"), *options, "--batch-size", "7", "--workers", "2"]) == 0
    assert main([str(folder), "-o", str(tmp_path / "one_batch"), *options, "--batch-size", "10000"]) == 0
    serial = _files(tmp_path / "serial")
    assert _files(tmp_path / "parallel") == serial
    assert _files(tmp_path / "one_batch") == serial
    assert TokenFile.open(tmp_path / "serial").num_documents == 5 * 40 * 2 + 2


def test_an_error_in_a_worker_is_one_line(tmp_path, capsys):
    folder = _corpus(tmp_path / "corpus")
    assert main([str(folder), "-o", str(tmp_path / "x"), "--workers", "2", "--eos-id", "46"]) == 2  # 46 is "."
    assert "part0.jsonl:1 contains the eos id 46 (document 0, token 10)" in _one_error_line(capsys)


def test_verify_reads_every_id_and_records_a_missing_max_id(texts, tmp_path, capsys):
    assert main([str(texts / "a.txt"), "-o", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    raw = json.loads((tmp_path / "a.json").read_text())
    del raw["max_id"]  # a sidecar written before max_id was recorded
    (tmp_path / "a.json").write_text(json.dumps(raw))
    assert main(["--verify", str(tmp_path / "a")]) == 0
    assert "max_id=119 (now recorded in the sidecar)" in capsys.readouterr().out  # "w"
    assert json.loads((tmp_path / "a.json").read_text())["max_id"] == 119
    (tmp_path / "a.bin").write_bytes(bytes(len((tmp_path / "a.bin").read_bytes())))  # all zeros now
    assert main(["--verify", str(tmp_path / "a")]) == 2
    assert "records max_id=119, but the largest id" in _one_error_line(capsys)
    with pytest.raises(SystemExit):
        main(["--verify", str(tmp_path / "a"), "-o", str(tmp_path / "b")])  # one mode at a time


def _word_tokenizer(tmp_path: Path) -> Path:
    """A tiny word-level ``tokenizer.json`` with ids for the corpus of ``_corpus`` (the rest is [UNK])."""
    import tokenizers  # the tokenizers extra; CI installs it with dev (missing: a failure, not a skip)

    vocab = {"[UNK]": 0, "</s>": 1, "document": 2, "word": 3, "second": 4, "block": 5, ".": 6, "a": 7, "story": 8}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.normalizer = tokenizers.normalizers.Lowercase()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    return tmp_path / "tok"


def _console_script() -> str:
    script = shutil.which("sppo-prepare", path=str(Path(sys.executable).parent))
    if script is None:  # README's set-up installs it; a test that cannot find it must say so, not skip
        raise AssertionError("the sppo-prepare console script is not installed (pip install -e .)")
    return script


@pytest.mark.slow
def test_console_script(texts, tmp_path):
    """The installed script as a user starts it; its bad-input run is the same script's code forked from the
    preloaded server (``tests/preloaded.py``), which leaves out a second start of the interpreter."""
    script = _console_script()
    env = one_thread_env()
    ok = subprocess.run([script, str(texts), "--output", str(tmp_path / "c")], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert TokenFile.open(tmp_path / "c").num_documents == 2
    bad = preloaded.run(
        [sys.executable, script, str(tmp_path / "missing.txt"), "--output", str(tmp_path / "d")], env=env
    )
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [
        f"sppo-prepare: error: INPUT {str(tmp_path / 'missing.txt')!r} not found (a text file or a folder of them)"
    ]


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


def test_an_existing_token_file_is_replaced_only_when_asked(tmp_path, capsys):
    """A run may be reading it (and resuming on it): a second prepare to the same name says so, --replace does it."""
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.txt").write_text("second text")
    assert main([str(tmp_path / "a.txt"), "--output", str(tmp_path / "tok")]) == 0
    capsys.readouterr()
    assert main([str(tmp_path / "b.txt"), "--output", str(tmp_path / "tok")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "tok.bin' exists" in line and "--replace" in line and _documents(tmp_path / "tok") == ["first"]
    assert main([str(tmp_path / "b.txt"), "--output", str(tmp_path / "tok"), "--replace"]) == 0
    assert _documents(tmp_path / "tok") == ["second text"]  # the negative control: asked, it replaces
