"""The Hugging Face model directory shared by every backend: init-model (every architecture), the
checks run before a run starts, the torch trainer + torch generation worker on that same model. A short
`sc-grpo run` on a directory `model.create` writes: tests/e2e/test_hf_model_runs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="the HF model directory needs transformers (the `hf` extra)")

import safetensors  # noqa: E402
import torch  # noqa: E402

from replay.storage import InMemoryRowStorage, row_keys  # noqa: E402
from single_controller.algorithm.logprobs import token_logprobs  # noqa: E402
from single_controller.backends.torch.generation import GenerationCore  # noqa: E402
from single_controller.backends.torch.model import build_policy, load_hf_policy, save_policy, state_module  # noqa: E402
from single_controller.backends.torch.trainer import TrainerCore  # noqa: E402
from single_controller.config.schema import TrainConfig  # noqa: E402
from single_controller.data import hf_model  # noqa: E402
from single_controller.data.bpe import write_bpe_tokenizer  # noqa: E402
from single_controller.data.tasks import TOKENIZER  # noqa: E402
from single_controller.data.tokenizer import load_tokenizer  # noqa: E402
from single_controller.preflight.loader import ConfigError, check_environment, load_config  # noqa: E402
from single_controller.runtime.cli import main as cli_main  # noqa: E402
from single_controller.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.helpers.chat_prompts import chat_prompts  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return hf_model.init_model(tmp_path_factory.mktemp("hf") / "tiny", hidden_size=64, seed=0)


def test_init_model_writes_a_tiny_llama_with_the_tasks_tokenizer(model_dir):
    cfg = hf_model.read_config(model_dir)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], hf_model.head_dim_of(cfg)) == (64, 2, 32)
    assert cfg["tie_word_embeddings"] is False and cfg["vocab_size"] == TOKENIZER.vocab_size
    assert hf_model.model_dir_problems(model_dir, vllm_cpu=True, min_positions=8) == []
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    text = "^" + "0123456789" + ">+-=:?$_"
    assert tok(text)["input_ids"] == TOKENIZER.encode(text)  # no BOS added, one token per character
    assert tok.decode(TOKENIZER.encode("^321>")) == "^321>"
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        TOKENIZER.bos_id,
        TOKENIZER.eos_id,
        TOKENIZER.pad_id,
    )


def test_init_model_command(tmp_path):
    assert cli_main(["init-model", str(tmp_path / "m"), "--hidden-size", "128", "--seed", "1"]) == 0
    cfg = hf_model.read_config(tmp_path / "m")
    assert (cfg["hidden_size"], cfg["num_attention_heads"]) == (128, 4)


# Per arch: the HF class, and which attention extras a layer's tensors show (q/k/v biases, per-head q/k norms)
ARCH_LAYOUT = {
    "llama": ("LlamaForCausalLM", False, False),
    "qwen2": ("Qwen2ForCausalLM", True, False),
    "qwen3": ("Qwen3ForCausalLM", False, True),
    "gpt2": ("GPT2LMHeadModel", False, False),
}


def _tensor_names(model_dir: Path) -> set[str]:
    with safetensors.safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("arch", hf_model.ARCHS)
def test_init_model_command_writes_each_arch_with_its_attention_extras(arch, tmp_path):
    assert set(ARCH_LAYOUT) == set(hf_model.ARCHS)
    assert cli_main(["init-model", str(tmp_path / arch), "--arch", arch, "--seed", "1"]) == 0
    cfg = hf_model.read_config(tmp_path / arch)
    cls, qkv_bias, qk_norm = ARCH_LAYOUT[arch]
    assert cfg["architectures"] == [cls] and cfg["tie_word_embeddings"] is False
    assert hf_model.head_dim_of(cfg) == 32 and cfg.get("num_hidden_layers", cfg.get("n_layer")) == 2
    if arch in ("qwen2", "qwen3"):  # Qwen3 names its head size; Qwen2's is hidden_size / heads, as in real ones
        assert ("head_dim" in cfg) is (arch == "qwen3")
    ids = (cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"])
    tok = load_tokenizer(str(tmp_path / arch))  # the default: a BPE with a chat template, no BOS
    assert tok.has_chat_template and ids == (tok.vocab_size, None, tok.eos_ids[0], tok.pad_id)
    assert "lm_head.weight" in _tensor_names(tmp_path / arch)
    assert cli_main(["init-model", str(tmp_path / "t"), "--arch", arch, "--tie-embeddings"]) == 0
    assert hf_model.read_config(tmp_path / "t")["tie_word_embeddings"] is True
    assert "lm_head.weight" not in _tensor_names(tmp_path / "t")  # one tensor, the embedding
    tied = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "t"))
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    assert cli_main(["init-model", str(tmp_path / "c"), "--arch", arch, "--tokenizer", "char"]) == 0
    cfg = hf_model.read_config(tmp_path / "c")
    ids = (cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"])
    assert ids == (TOKENIZER.vocab_size, TOKENIZER.bos_id, TOKENIZER.eos_id, TOKENIZER.pad_id)
    assert load_tokenizer(str(tmp_path / "c")) is TOKENIZER
    if arch != "gpt2":
        assert cfg["rope_parameters"]["rope_theta"] == hf_model.ROPE_THETA
    assert hf_model.model_dir_problems(tmp_path / arch, vllm_cpu=True, min_positions=8) == []
    with safetensors.safe_open(str(tmp_path / arch / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert ("model.layers.1.self_attn.q_proj.bias" in names) is qkv_bias
    assert ({"model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= names) is qk_norm
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / arch))
    assert type(model).__name__ == cls


def test_model_dir_problems_name_what_is_wrong(tmp_path, model_dir):
    (missing,) = hf_model.model_dir_problems(tmp_path / "absent")
    assert "does not exist" in missing and "sc-grpo init-model" in missing

    no_tok = tmp_path / "no_tok"
    hf_model.init_model(no_tok, hidden_size=64)
    (no_tok / "tokenizer.json").unlink()
    (problem,) = hf_model.model_dir_problems(no_tok)
    assert "no tokenizer" in problem

    small = tmp_path / "hd16"
    hf_model.init_model(small, hidden_size=64, head_dim=16)
    assert hf_model.model_dir_problems(small) == []  # fine for torch
    (problem,) = hf_model.model_dir_problems(small, vllm_cpu=True)
    assert "head_dim 16" in problem and "vLLM's CPU attention" in problem

    other = tmp_path / "other_vocab"  # a 19-token model given a 300-token tokenizer
    hf_model.init_model(other, hidden_size=64)
    write_bpe_tokenizer(other, 300)
    (problem,) = hf_model.model_dir_problems(other)
    assert f"vocab_size {TOKENIZER.vocab_size} < the tokenizer's 300 tokens" in problem


def test_a_built_in_task_with_a_model_of_another_tokenizer_is_refused_before_anything_starts(tmp_path):
    bpe = hf_model.init_model(tmp_path / "bpe", hidden_size=64, tokenizer="bpe", vocab_size=300)
    with pytest.raises(ConfigError, match="(?s)character tokenizer, but the model in.*has another"):
        check_environment(load_config(None, [f"model.path={bpe}"]))
    new = f"model.path={tmp_path / 'new'}"
    with pytest.raises(ConfigError, match="(?s)model.create would.*write a BPE"):
        check_environment(load_config(None, [new, "model.create=true", "model.tokenizer=bpe"]))
    check_environment(load_config(None, [new, "model.create=true"]))  # auto: char for a built-in task


def test_bad_model_dirs_are_reported_before_anything_starts(tmp_path, model_dir):
    def problems(*overrides):
        with pytest.raises(ConfigError) as e:
            check_environment(load_config(None, list(overrides)))
        return str(e.value)

    assert "does not exist" in problems(f"model.path={tmp_path / 'nope'}")
    check_environment(load_config(None, [f"model.path={model_dir}"]))  # a good one passes
    # model.create with a head size vLLM's CPU attention cannot run (64 / 4 heads = 16)
    msg = problems(f"model.path={tmp_path / 'new'}", "model.create=true", "backend.generation=vllm")
    assert "head_dim = model.d_model / model.n_heads = 64 / 4 = 16" in msg
    with pytest.raises(ConfigError, match="needs model.path"):
        load_config(None, ["backend.generation=vllm"])
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, [f"model.path={model_dir}", "model.checkpoint=x"])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_init_model_writes_grouped_query_attention_and_the_mlp_width_asked_for(arch, tmp_path, capsys):
    """Qwen2.5-0.5B's shape in small: fewer key/value heads than query heads, its own MLP width."""
    sizes = ["--hidden-size", "128", "--head-dim", "32", "--num-kv-heads", "2", "--intermediate-size", "96"]
    assert cli_main(["init-model", str(tmp_path / "m"), "--arch", arch, *sizes]) == 0
    cfg = hf_model.read_config(tmp_path / "m")
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]) == (4, 2, 96)
    names = _tensor_names(tmp_path / "m")
    with safetensors.safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        k_proj = f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape()
        gate = f.get_slice("model.layers.0.mlp.gate_proj.weight").get_shape()
    assert "model.layers.0.self_attn.k_proj.weight" in names and k_proj == [2 * 32, 128] and gate == [96, 128]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"))
    assert model(torch.tensor([[1, 2, 3]])).logits.shape[:2] == (1, 3)
    assert hf_model.model_dir_problems(tmp_path / "m", vllm_cpu=True, min_positions=8) == []
    for arch_, kv in (("gpt2", "2"), (arch, "3")):  # GPT-2 has no GQA; 3 does not divide 4 query heads
        with pytest.raises(SystemExit):
            cli_main(["init-model", str(tmp_path / "x"), "--arch", arch_, "--hidden-size", "128", "--num-kv-heads", kv])
        assert "--num-kv-heads" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_model_create_writes_the_key_value_heads_and_mlp_width_of_the_config(tmp_path):
    over = ["model.create=true", "model.arch=qwen2", "model.d_model=128", "model.n_heads=4", "model.n_kv_heads=2"]
    cfg = load_config(None, [f"model.path={tmp_path / 'm'}", *over, "model.d_ff=96"])
    assert hf_model.prepare_model_dir(cfg.model, cfg.seed)
    written = hf_model.read_config(tmp_path / "m")
    assert (written["num_key_value_heads"], written["intermediate_size"]) == (2, 96)
    for wrong, said in (
        ([f"model.path={tmp_path / 'n'}", *over, "model.n_kv_heads=3"], "must divide model.n_heads (4)"),
        ([f"model.path={tmp_path / 'n'}", *over, "model.arch=gpt2"], "GPT-2 model has one key/value head"),
        (["model.n_kv_heads=2"], "the embedded TinyGPT"),  # it takes neither size
        ([f"model.path={tmp_path / 'm'}", "model.d_ff=96"], "an existing model directory has its own"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, wrong)
        assert len(err.value.problems) == 1 and said in " ".join(str(err.value).split()), str(err.value)


def test_prepare_model_dir_writes_once(tmp_path):
    cfg = load_config(None, [f"model.path={tmp_path / 'm'}", "model.create=true", "model.n_heads=2", "seed=4"])
    assert hf_model.prepare_model_dir(cfg.model, cfg.seed)
    assert hf_model.head_dim_of(hf_model.read_config(tmp_path / "m")) == 32
    assert not hf_model.prepare_model_dir(cfg.model, cfg.seed)  # already there: left alone
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", hf_model.ARCHS)
def test_torch_trainer_and_generator_share_the_hf_model(arch, tied, tmp_path):
    """The torch trainer trains the directory's model, publishes snapshots under the checkpoint's own
    parameter names (a tied head: the embedding alone), and the torch generation worker (same model)
    reproduces the trainer's logprobs."""
    model_dir = hf_model.init_model(  # prompts through its chat template
        tmp_path / arch, arch=arch, tokenizer="bpe", tie_embeddings=tied
    )
    assert hf_model.model_dir_problems(model_dir, vllm_cpu=True, min_positions=8) == []
    cfg = load_config(None, [f"model.path={model_dir}"])
    tok = load_tokenizer(str(model_dir))
    trainer = TrainerCore(build_policy(cfg.model, tok.vocab_size, seed=0), TrainConfig())
    snap = trainer.publish_weights(0)
    names = {e.name for e in snap.manifest.entries}
    assert ("lm_head.weight" in names) is not tied  # HF checkpoint names, no adapter prefix
    assert ("transformer.wte.weight" if arch == "gpt2" else "model.embed_tokens.weight") in names
    with safetensors.safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())  # exactly the checkpoint's tensors

    with torch.no_grad():  # move the trainer's weights away from the directory's
        for p in trainer.params:
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    snap = trainer.publish_weights(1)
    storage = InMemoryRowStorage()
    gen = GenerationCore(
        build_policy(cfg.model, tok.vocab_size, seed=0).requires_grad_(False),
        storage,
        cfg.task.reward_fn,
        tokenizer=tok,
    )
    gen.load_weights(snap)
    prompts = chat_prompts(model_dir, 4, seed=0)
    reqs = [
        GenerationRequest(f"g{i}", p, SamplingParams(n=4, max_new_tokens=3), row_keys(f"g{i}", 4))
        for i, p in enumerate(prompts)
    ]
    results = gen.generate(reqs)
    assert all(r.version_start == r.version_end == 1 for r in results)
    keys = [k for r in reqs for k in r.row_keys]
    rows = storage.get_rows_sync(keys, ["prompt_ids", "response_ids", "gen_logprobs"])
    with torch.no_grad():
        lp, _ = token_logprobs(trainer.policy, rows["prompt_ids"], rows["response_ids"])
    gen_lp = torch.stack(list(rows["gen_logprobs"]))
    assert torch.allclose(lp, gen_lp, atol=1e-5, rtol=0), float((lp - gen_lp).abs().max())

    out = save_policy(trainer.policy, tmp_path / "ckpt", cfg.model)
    assert hf_model.model_dir_problems(out) == []
    assert hf_model.read_config(out)["model_type"] == arch and load_tokenizer(str(out)).has_chat_template
    back = load_hf_policy(out)
    for (n, a), (_, b) in zip(state_module(trainer.policy).named_parameters(), state_module(back).named_parameters()):
        assert torch.equal(a, b), n
