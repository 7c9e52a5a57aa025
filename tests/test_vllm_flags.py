"""vLLM's habitual flags (issue 41; docs/serving.md, "Flags from vLLM"); help, `--version`, the
progress bar and each entry point's defaults: test_command_help.py.

- Two real `rlt serve` processes: one with --ssl-keyfile/--ssl-certfile (a self-signed
  certificate made here), --seed, --chat-template (a file), --tokenizer (the model directory
  then holds no tokenizer), --enforce-eager, --trust-remote-code, --tensor-parallel-size 1 and
  --disable-log-requests, answered over https only, and benchmarked there by `rlt bench serve`
  with each of vLLM's options (the certificate trusted through SSL_CERT_FILE, as vLLM's client
  trusts it); one with --uvicorn-log-level warning, whose output keeps rlt's INFO lines and
  loses uvicorn's.
- Refusals before anything starts: --tensor-parallel-size 2 (naming what exists instead),
  --ssl-keyfile without a certificate, a --chat-template that is neither file nor template, a
  --tokenizer directory without a tokenizer; an unknown flag prints the subcommand's usage
  (`rlt pd serve`'s too, before any instance starts).
- `rlt pd serve` takes the front flags (the settings it hands its front, the engine flags and
  --tokenizer it resolves for its instances) and refuses -tp 2; `rlt ray` takes --seed and
  --chat-template and refuses TLS.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time

import httpx
import pytest
from rlt.cli import build_parser, engine_config_from_args, main
from rlt.engine.assembly import DEFAULT_MODEL_DIR
from rlt_serve.exit_codes import EXIT_USAGE
from serving_harness import free_port

CHAT_TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>> {% endif %}"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ACCESS_LINE = '"POST /v1/completions HTTP/1.1" 200'


def self_signed_certificate(directory) -> tuple[str, str]:
    """(key file, certificate file) for 127.0.0.1, made with `cryptography`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_file, cert_file = directory / "key.pem", directory / "cert.pem"
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return str(key_file), str(cert_file)


class Served:
    """`rlt serve` as a process, its output collected on a thread."""

    def __init__(self, *argv: str) -> None:
        command = [sys.executable, "-m", "rlt.cli", "serve", *argv, "--device", "cpu"]
        command += ["--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "256"]
        env = {k: v for k, v in OFFLINE.items() if k != "RLT_API_KEY"}
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} in the server's output:\n{self.output}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(subprocess.signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.reader.join(timeout=10)


def bench_over_https(url: str, cert: str, tokenizer, tmp_path, capsys, monkeypatch) -> None:
    """`rlt bench serve` with each of vLLM's options against the https server at `url`: its
    certificate trusted through SSL_CERT_FILE alone, as vLLM's client trusts it (no
    --trust-env); without it, the certificate is refused. Each run's JSON has vLLM's keys."""
    from test_bench_serve_vllm_options import VLLM_KEYS, conversation, latency_keys

    tmp_path.mkdir()
    sharegpt = tmp_path / "sharegpt.json"
    reply = "It was the best of times, it was the worst of times, it was the age of wisdom."
    sharegpt.write_text(json.dumps([conversation("Tell me of Emma.", reply, cid="a")]))
    base = ["bench", "serve", "--base-url", url, "--disable-tqdm", "--save-result"]
    base += ["--result-dir", str(tmp_path), "--num-prompts", "2"]
    runs = {
        "chat.json": "--backend openai-chat --dataset-name sharegpt --sharegpt-output-len 4 "
        f"--dataset-path {sharegpt} --tokenizer {tokenizer} --num-warmups 1 "
        "--percentile-metrics ttft,e2el --metric-percentiles 50,99",
        "completions.json": "--backend openai --random-input-len 6 --random-prefix-len 4 "
        "--random-output-len 3 --ignore-eos",
    }
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    assert main([*base, "--result-filename", "refused.json"]) != 0
    assert "CERTIFICATE_VERIFY_FAILED" in capsys.readouterr().err
    monkeypatch.setenv("SSL_CERT_FILE", cert)
    for name, flags in runs.items():
        assert main([*base, "--result-filename", name, *flags.split()]) == 0, capsys.readouterr()
    chat = json.loads((tmp_path / "chat.json").read_text())
    assert (chat["backend"], chat["endpoint"]) == ("openai-chat", "/v1/chat/completions")
    assert (chat["completed"], chat["num_warmups"], chat["output_lens"]) == (2, 1, [4, 4])
    for key in VLLM_KEYS + latency_keys("ttft", (50, 99)) + latency_keys("e2el", (50, 99)):
        assert key in chat, key
    assert "p50_tpot_ms" not in chat
    plain = json.loads((tmp_path / "completions.json").read_text())
    assert (plain["backend"], plain["endpoint"]) == ("openai", "/v1/completions")
    assert (plain["completed"], plain["input_lens"], plain["random_prefix_len"]) == (2, [10] * 2, 4)
    assert all(key in plain for key in VLLM_KEYS)


@pytest.mark.slow
def test_rlt_serve_takes_vllms_flags(tmp_path, capsys, monkeypatch):
    model, tokenizer = tmp_path / "model", tmp_path / "tokenizer"
    model.mkdir()
    tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(DEFAULT_MODEL_DIR / name, model / name)
    for name in TOKENIZER_FILES:  # the model directory holds none: --tokenizer's is used
        shutil.copy(DEFAULT_MODEL_DIR / name, tokenizer / name)
    key, cert = self_signed_certificate(tmp_path)
    template = tmp_path / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    port = free_port()
    server = Served(
        str(model), "--port", str(port), "--tokenizer", str(tokenizer),
        "--ssl-keyfile", key, "--ssl-certfile", cert, "--seed", "1234",
        "--chat-template", str(template), "--enforce-eager", "--trust-remote-code",
        "--tensor-parallel-size", "1", "--disable-log-requests", "--served-model-name", "tiny",
    )  # fmt: skip
    try:
        server.wait_for(f"ready at https://127.0.0.1:{port}")
        with httpx.Client(
            base_url=f"https://127.0.0.1:{port}",
            verify=ssl.create_default_context(cafile=cert),
            timeout=60,
        ) as https:
            body = {"prompt": "It is a truth", "max_tokens": 12, "temperature": 1.0}
            unseeded = [https.post("/v1/completions", json=body).json() for _ in range(2)]
            seeded = https.post("/v1/completions", json={**body, "seed": 1234}).json()
            other = https.post("/v1/completions", json={**body, "seed": 99}).json()
            texts = [r["choices"][0]["text"] for r in (*unseeded, seeded, other)]
            # --seed 1234 is the seed of requests that give none; a given seed still wins
            assert texts[0] == texts[1] == texts[2] != texts[3], texts
            messages = [{"role": "user", "content": "Hello"}]
            ids = https.post("/tokenize", json={"messages": messages}).json()["tokens"]
            rendered = https.post("/detokenize", json={"tokens": ids}).json()["prompt"]
            assert rendered == "<<user>> Hello\n<<assistant>> "  # --chat-template's file
        url = f"https://127.0.0.1:{port}"
        bench_over_https(url, cert, tokenizer, tmp_path / "bench", capsys, monkeypatch)
        with pytest.raises(httpx.TransportError):  # TLS only: plain HTTP gets no answer
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        server.stop()
        assert server.process.returncode == 0, server.output
        output = server.output
        assert "--trust-remote-code changes nothing: rlt never runs code from a checkpoint" in (
            output
        )
        assert "Application startup complete" in output  # uvicorn's INFO lines stay
        assert ACCESS_LINE not in output and "GET /health" not in output  # no request lines
        assert "Traceback" not in output
    finally:
        server.stop()


@pytest.mark.slow
def test_uvicorn_log_level_sets_uvicorns_loggers_only():
    port = free_port()
    server = Served("--port", str(port), "--uvicorn-log-level", "warning", "--log-level", "info")
    try:
        server.wait_for(f"ready at http://127.0.0.1:{port}")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False) as http:
            body = {"prompt": "It is", "max_tokens": 2}
            assert http.post("/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        server.stop()
    output = server.output
    assert "INFO rlt.startup [api]: start-up:" in output  # rlt's own INFO lines
    assert "INFO rlt.startup [core]: start-up:" in output
    for uvicorn_info in ("Application startup complete", "Uvicorn running", ACCESS_LINE):
        assert uvicorn_info not in output, output


def test_enforce_eager_turns_cuda_graphs_off():
    args = build_parser().parse_args(["serve", "--enforce-eager"])
    config = engine_config_from_args(args)
    assert (config.runner.cuda_graphs, config.runner.prefill_cuda_graphs) == (False, False)
    default = engine_config_from_args(build_parser().parse_args(["serve"]))
    assert (default.runner.cuda_graphs, default.runner.prefill_cuda_graphs) == (True, True)


# -- refusals, before anything starts ------------------------------------------------------------


@pytest.fixture
def nothing_starts(monkeypatch):
    from rlt.serving.core_process_client import CoreProcess

    def started(*args, **kwargs):
        raise AssertionError("started although the command line was refused")

    for name in ("spawn", "start"):
        monkeypatch.setattr(CoreProcess, name, started)
    monkeypatch.setattr("rlt.llm.LLM.from_config", started)


def refused(argv: list[str], capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    return err


@pytest.mark.parametrize(
    "argv",
    [["serve", "--tensor-parallel-size", "2"], ["generate", "-tp", "4", "It is"]],
    ids=["serve", "generate"],
)
def test_tensor_parallelism_is_refused_naming_what_exists(argv, capsys, nothing_starts):
    error = refused([*argv, "--port", str(free_port())] if argv[0] == "serve" else argv, capsys)
    assert "tensor_parallel_size:" in error and "has no tensor parallelism" in error
    assert "rlt pd serve --replicas N" in error and "rlt ray serve --replicas N" in error
    assert "--quantization fp8 --kv-cache-dtype fp8" in error


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ssl-keyfile", "key.pem"], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-certfile", "{tmp}/cert.pem"], "'{tmp}/cert.pem' is not a file"),
        (["--ssl-certfile", "{tmp}/junk.pem"], "cannot load the certificate and its key"),
        (["--chat-template", "chatml"], "'chatml' is neither a file nor a Jinja template"),
        (["--tokenizer", "{tmp}"], "{tmp} holds no tokenizer; it lacks the tokenizer"),
        (["--seed", "-1"], "seed: must be in [0, 2**63), got -1"),
    ],
    ids=[
        "key without certificate",
        "no such certificate",
        "not a certificate",
        "template",
        "tokenizer",
        "seed",
    ],
)
def test_bad_flag_values_are_refused_with_the_flag_named(
    flags, message, tmp_path, capsys, nothing_starts
):
    (tmp_path / "junk.pem").write_text("not PEM")
    argv = ["serve", *(f.format(tmp=tmp_path) for f in flags), "--port", str(free_port())]
    assert message.format(tmp=tmp_path) in refused(argv, capsys)


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["serve", "--no-such-flag", "1"], "rlt serve"),
        (["generate", "It is", "--no-such-flag"], "rlt generate"),
        (["bench", "serve", "--no-such-flag"], "rlt bench serve"),
        (["pd", "serve", "--no-such-flag"], "rlt pd serve"),  # not hidden by a missing role
        (["pd", "serve", "--replicas", "1", "--no-such-flag"], "rlt pd serve"),  # none starts
    ],
)
def test_an_unknown_flag_prints_the_subcommands_usage(argv, command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {command} ")
    assert f"{command}: error: unrecognized arguments: --no-such-flag" in err


def test_tensor_parallel_size_1_is_a_flag_not_the_model_directory():
    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "1"])
    assert (args.model_dir, args.tensor_parallel_size) == (None, 1)


# -- rlt pd serve and rlt ray: where the flags apply -------------------------------------------


def test_rlt_pd_serve_takes_the_front_flags(tmp_path):
    from rlt_pd_coordinator.cli import parse as parse_pd

    key, cert = self_signed_certificate(tmp_path)
    options = parse_pd(
        ["serve", "--replicas", "1", "--seed", "7", "--chat-template", CHAT_TEMPLATE,
         "--ssl-keyfile", key, "--ssl-certfile", cert, "--uvicorn-log-level", "error",
         "--disable-log-requests", "--tokenizer", str(DEFAULT_MODEL_DIR), "-tp", "1",
         "--enforce-eager"]
    )  # fmt: skip
    front = options.front
    assert (front.default_seed, front.chat_template, front.scheme) == (7, CHAT_TEMPLATE, "https")
    assert front.uvicorn_options("info") == {
        "log_level": "error",
        "access_log": False,
        "ssl_keyfile": key,
        "ssl_certfile": cert,
    }
    # engine flags pass to the local instances; --tokenizer too, once the coordinator resolved
    # it (a Hub id to its snapshot: test_hub_models.py)
    assert options.tokenizer == str(DEFAULT_MODEL_DIR)
    assert options.engine_args == ("--enforce-eager",)


def test_rlt_pd_serve_refuses_tensor_parallelism(capsys):
    error = refused(["pd", "serve", "--replicas", "1", "--tensor-parallel-size", "2"], capsys)
    assert "rlt pd: error: tensor_parallel_size: 2 GPUs per engine" in error


def test_rlt_ray_takes_seed_and_template_and_refuses_tls():
    rlt_ray_cli = pytest.importorskip("rlt_ray.cli")
    from rlt_contracts import ConfigurationError

    args = rlt_ray_cli.build_parser().parse_args(
        ["serve", "--seed", "7", "--chat-template", CHAT_TEMPLATE]
    )
    front = rlt_ray_cli.serve_options_from_args(args).front
    assert (front.default_seed, front.chat_template) == (7, CHAT_TEMPLATE)
    args = rlt_ray_cli.build_parser().parse_args(["serve", "--ssl-certfile", "cert.pem"])
    with pytest.raises(ConfigurationError, match="--ssl-certfile does not apply to rlt ray"):
        rlt_ray_cli.serve_options_from_args(args)
