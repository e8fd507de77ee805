"""The kernel of the weight products: which one is chosen, that it computes F.linear's numbers, bad names refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from kvpool.cli.commands import cli
from kvpool.engine.batch import SequenceChunk
from kvpool.engine.linear import LinearKernel, linear_function, select_linear_kernel
from kvpool.engine.model_runner import ModelRunner
from kvpool.engine.startup import EngineOptions
from kvpool.errors import ConfigError
from tests.engine.tiny_models import build_model, random_prompt

pytestmark = pytest.mark.engine

HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def test_the_default_is_onednn_for_float32_on_a_cpu_that_has_it_and_torch_otherwise():
    expected = LinearKernel.ONEDNN if HAS_ONEDNN else LinearKernel.TORCH
    assert select_linear_kernel("cpu", torch.float32) is expected
    assert select_linear_kernel("cpu", torch.bfloat16) is LinearKernel.TORCH  # bf16 not measured: left to torch
    assert select_linear_kernel("cpu", torch.float16) is LinearKernel.TORCH
    assert select_linear_kernel("cuda", torch.float32) is LinearKernel.TORCH  # the probe never runs for CUDA
    assert select_linear_kernel("cpu", torch.float32, "torch") is LinearKernel.TORCH
    assert select_linear_kernel("cpu", torch.float32, LinearKernel.TORCH) is LinearKernel.TORCH


@pytest.mark.parametrize("kind", ["cublas", "", "ONEDNN", 3, None.__class__])
def test_an_unknown_kernel_is_refused_by_name(kind):
    with pytest.raises(ConfigError, match="unknown linear kernel .*known: torch, onednn"):
        select_linear_kernel("cpu", torch.float32, kind)
    with pytest.raises(ConfigError, match="unknown linear kernel"):
        EngineOptions(model="smollm2-135m", linear_kernel=kind)  # refused before anything loads


@pytest.mark.parametrize(
    ("device", "dtype", "reason"),
    [("cuda", torch.float32, "run on the CPU, not on cuda"), ("cpu", torch.float16, "not torch.float16")],
)
def test_onednn_asked_for_where_it_cannot_run_says_why(device, dtype, reason):
    with pytest.raises(ConfigError, match=f"'onednn' cannot be used: .*{reason}"):
        select_linear_kernel(device, dtype, "onednn")


@pytest.mark.skipif(not HAS_ONEDNN, reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize(
    ("rows", "inputs", "outputs", "bias"), [(1, 576, 960, False), (7, 64, 200, True), (33, 96, 1, False)]
)
def test_onednn_computes_what_f_linear_computes(rows, inputs, outputs, bias):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inputs, generator=generator)
    weight = torch.randn(outputs, inputs, generator=generator) * 0.05
    b = torch.randn(outputs, generator=generator) if bias else None
    got = linear_function(LinearKernel.ONEDNN)(x, weight, b)
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    assert linear_function(LinearKernel.TORCH) is F.linear


@pytest.mark.skipif(not HAS_ONEDNN, reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])
def test_a_step_on_either_kernel_gives_the_same_logits(kind):
    model = build_model(kind)
    prompt = random_prompt(11, seed=3)
    logits = {}
    for kernel in ("torch", "onednn"):
        runner = ModelRunner.create(model, num_blocks=8, block_size=4, linear_kernel=kernel)
        assert runner.linear_kernel is LinearKernel(kernel)
        logits[kernel] = runner.execute([SequenceChunk("r", tuple(prompt), 0, ((1, 2, 3),), True)])
    torch.testing.assert_close(logits["onednn"], logits["torch"], atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        full = model(torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(logits["onednn"][0], full, atol=1e-4, rtol=1e-4)
    assert int(logits["onednn"].argmax()) == int(full.argmax())


def test_the_commands_take_the_kernel_and_refuse_an_unknown_one_before_loading():
    result = CliRunner().invoke(cli, ["generate", "hello", "--linear-kernel", "cublas"])
    assert result.exit_code != 0
    assert "unknown linear kernel 'cublas'; known: torch, onednn" in result.output
    assert "Traceback" not in result.output
    assert "--linear-kernel" in CliRunner().invoke(cli, ["serve", "--help"]).output
