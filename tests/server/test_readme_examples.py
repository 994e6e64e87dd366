"""The README's client examples run as written against a real TorchServe: the KServe v1 curl
call, tritonclient.http and tritonclient.grpc (the gRPC front in this process, forwarding to the
session's server). Only the addresses change, and the photos `a.jpg` and `b.png` are real ones."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from tests.images import CAT_LABELS, PHOTOS_DIR, photo_bytes
from torchserve_vision.grpc_front import GrpcFront
from torchserve_vision.server_process import TorchServeInstance

pytestmark = pytest.mark.server
README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"```(?P<language>\w+)\n(?P<code>.*?)```", re.DOTALL)


def readme_block(language: str, marker: str) -> str:
    blocks = [match["code"] for match in BLOCK.finditer(README.read_text())
              if match["language"] == language and marker in match["code"]]
    assert len(blocks) == 1, f"one {language} block with {marker!r} in the README"
    return blocks[0]


@pytest.fixture
def photos_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """a.jpg (a cat) and b.png (a cup of coffee) in the working directory, as the README has them."""
    Image.open(PHOTOS_DIR / "chelsea.png").convert("RGB").save(tmp_path / "a.jpg", quality=90)
    (tmp_path / "b.png").write_bytes(photo_bytes("coffee.png"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def grpc_front(server: TorchServeInstance) -> Iterator[GrpcFront]:
    with GrpcFront("127.0.0.1", 0, server.inference_url, timeout_s=60,
                   max_message_bytes=64 << 20) as front:
        yield front


def printed(code: str) -> str:
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(code, "README.md", "exec"), {})   # the README's own example
    return output.getvalue()


def test_the_kserve_v1_curl_example(server: TorchServeInstance, photos_here: Path):
    script = readme_block("bash", "v1/models").replace("http://127.0.0.1:8080", server.inference_url)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    predictions = json.loads(done.stdout)["predictions"]
    assert len(predictions) == 2 and predictions[0][0]["label"] in CAT_LABELS
    assert predictions[1][0]["label"] != predictions[0][0]["label"]


def test_the_tritonclient_http_example(server: TorchServeInstance, photos_here: Path):
    code = readme_block("python", "tritonclient.http").replace(
        "127.0.0.1:8080", server.inference_url.removeprefix("http://"))
    labels = printed(code)
    assert labels.count("[") == 3 and any(label in labels for label in CAT_LABELS)


def test_the_tritonclient_grpc_example(grpc_front: GrpcFront, photos_here: Path):
    code = readme_block("python", "tritonclient.grpc").replace("127.0.0.1:8001",
                                                              f"127.0.0.1:{grpc_front.port}")
    labels = printed(code)
    assert re.fullmatch(r"\[\[b'[^']+' b'[^']+' b'[^']+'\]\]\n", labels), labels
    assert any(f"b'{label}'" in labels for label in CAT_LABELS)
