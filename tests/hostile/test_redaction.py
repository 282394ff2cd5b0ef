"""Credentials never reach a message: one redaction (``redact_text``) for the library
and everything the CLI prints, tested on every command with a URL carrying a key and
a secret."""

from __future__ import annotations

from pathlib import Path

import pytest

import stalwart
from stalwart.redact import redact_text, redact_url, url_secrets

from ..conftest import cli, make_parts

KEY = "AKIAFAKEKEY0123"
SECRET = "FAKEsecretVALUE/456+xyz"
S3 = f"s3://{KEY}:{SECRET}@bucket/prefix"
MEMORY = f"memory://{KEY}:{SECRET}@bucket/prefix"


def assert_hidden(*texts: str) -> None:
    for text in texts:
        for part in (KEY, SECRET, "FAKEsecretVALUE", "456+xyz"):
            assert part not in text, text


@pytest.mark.parametrize(
    "text",
    [
        S3,
        f"cannot open {S3}: denied",
        f"{KEY}:{SECRET}@bucket/prefix",
        f"got '{KEY}:{SECRET}@bucket/prefix'",
        # Path("s3://...") prints one slash: the URL taken for a directory name.
        f"/home/me/s3:/{KEY}:{SECRET}@bucket/prefix: no such file or directory",
        f"https://host/b/k?X-Amz-Credential={KEY}&X-Amz-Signature={SECRET}&x=1",
        f"https://acct.blob.core.windows.net/c/k?sv=2022-11-02&sig={SECRET}",
        f"https://api/x?access_token={SECRET}",
    ],
)
def test_redact_text_hides_every_form_of_credential(text: str) -> None:
    redacted = redact_text(text)
    assert_hidden(redacted)
    assert "***" in redacted
    assert redact_text(redacted) == redacted


def test_redact_keeps_the_rest_of_a_url() -> None:
    assert redact_url(S3) == "s3://***@bucket/prefix"
    assert redact_url("s3://bucket/prefix") == "s3://bucket/prefix"
    assert redact_url("hf://datasets/org/name@main/x") == "hf://datasets/org/name@main/x"
    assert redact_text("pid 12 on host-1 (since 2026-11-30), mail ops@example.com") == (
        "pid 12 on host-1 (since 2026-11-30), mail ops@example.com"
    )


def test_exact_secrets_are_hidden_wherever_they_appear() -> None:
    secrets = url_secrets(f"ls {S3}")
    assert KEY in secrets and SECRET in secrets
    assert_hidden(redact_text(f"odd place for {SECRET} and {KEY}", secrets))


def test_a_durable_url_without_its_scheme_is_refused_without_echoing_the_secret(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match=r"object-store URL") as caught:
        stalwart.CheckpointManager(tmp_path / "run", durable=f"{KEY}:{SECRET}@bucket/p")
    assert_hidden(str(caught.value))
    assert "***@bucket/p" in str(caught.value)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    with stalwart.CheckpointManager(run) as ckpt:
        ckpt.save(1, make_parts().state)
    return run


COMMANDS = {
    "ls": ["ls", MEMORY],
    "ls-json": ["ls", "--json", MEMORY],
    "gc": ["gc", "--dry-run", MEMORY],
    "gc-force": ["gc", "--force", MEMORY],
    "inspect": ["inspect", S3],
    "verify": ["verify", S3],
    "export": ["export", S3, "--to", "out.safetensors"],
    "export-to": ["export", "{run}", "--to", f"{S3}/model.safetensors"],
    "diff": ["diff", S3, f"s3://{KEY}:{SECRET}@bucket/other"],
    "diff-run": ["diff", "{run}", S3],
    "report": ["report", S3],
    "report-out": ["report", "{run}", "--out", S3],
    "restore-test": ["restore-test", "--build", "nomodule:build", S3],
    "restore-test-path": ["restore-test", "--build", "nomodule:build", "--path", S3, "{run}"],
    "plan-measure": ["plan", "--params", "7B", "--measure", S3],
    "plan-bad-size": ["plan", "--params", "7B", "--gpu-mem", S3],
    "unknown-flag": ["verify", "--bogus", S3],
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_no_command_prints_the_secret_of_a_url(
    name: str,
    run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = [arg.replace("{run}", str(run)) for arg in COMMANDS[name]]
    code, out, err = cli(capsys, *argv)
    assert_hidden(out, err)
    assert "Traceback" not in err
    if code != 0:
        assert err.strip(), out
