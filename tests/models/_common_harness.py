"""transformers' own `ModelTesterMixin` and `ConfigTester`, applied to our classes (the harness; the test
classes live in test_transformers_common_*.py, split so that `pytest -n 2 --dist loadfile` spreads them).

The tests come from the sdist of the installed transformers version, downloaded once at test time and cached
(`_transformers_tests.py`); without network the module is skipped with the reason. They run for every
architecture (dense, MoE, MoD, hybrid) and both MoE implementations (native, DeepSpeed), with a tester shaped
like transformers' `CausalLMModelTester` (batch 13, sequence 7, 2 layers, hidden 32).

Llama and Mixtral run through the same harness as references (ADAPTIVE_HF_REFERENCES=1): any test they fail here is a harness
limit, not ours. Expected failures are listed per class in `EXPECTED_FAILURES` with the reason; each is marked
`xfail(strict=True)` (tests/models/conftest.py), so a listed test that starts passing fails the suite and
must leave the list. Only differences by definition are accepted.

Importing this module raises `_transformers_tests.Unavailable` when the sdist cannot be fetched; the test
modules turn that into a module-level skip with the reason.
"""

from __future__ import annotations

import unittest
from unittest import mock

import torch
from _transformers_tests import load

common, configuration = load()  # raises Unavailable: the test modules skip

from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel, MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers import MixtralModel  # noqa: E402
from transformers.models.auto import modeling_auto  # noqa: E402

from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM, AdaptiveModel  # noqa: E402

ids_tensor = common.ids_tensor

# block_types per architecture, 2 layers as in transformers' testers; mod/hybrid keep one plain layer so
# the mix of routed and unrouted layers is tested too.
BLOCKS = {
    "dense": ["dense", "dense"],
    "moe": ["moe", "moe"],
    "mod": ["dense", "mod"],
    "hybrid": ["moe", "hybrid"],
}

# Why a test may fail for an architecture by definition. Keys are regular expressions over test names.
_BATCH_STATISTICS = (
    "router_stats and aux_loss are statistics of the whole batch (expert counts, load-balancing and z-losses, "
    "dropped fraction, MoD skip rate and BCE): one row alone gives other values by definition. Logits, hidden "
    "states and attentions are batch-independent: test_hf_usage.py::test_batched_and_single_row_outputs_agree"
)
_CHECKPOINT_LAYOUT = (
    "the DeepSpeed block's state_dict has DeepSpeed's names (deepspeed_moe.experts.deepspeed_experts.{i}...); its "
    "checkpoint is written in the native (Mixtral) layout so that one checkpoint loads into either block, so the "
    "file's keys differ from the module's by design (loading converts: test_moe.py)"
)
EXPECTED_FAILURES: dict[str, dict[str, str]] = {
    "dense": {},
    "moe": {"test_batching_equivalence": _BATCH_STATISTICS},
    "moe_deepspeed": {"test_batching_equivalence": _BATCH_STATISTICS},
    "mod": {"test_batching_equivalence": _BATCH_STATISTICS},
    "hybrid": {"test_batching_equivalence": _BATCH_STATISTICS},
}
# Differences by definition in tests that fail in subtests, which xfail does not cover: skipped with the reason.
SKIPPED_BY_DEFINITION: dict[str, dict[str, str]] = {
    "moe_deepspeed": {"test_can_use_safetensors": _CHECKPOINT_LAYOUT,
                      "test_load_save_without_tied_weights": _CHECKPOINT_LAYOUT},
}

# transformers' eager-vs-SDPA matrix runs where an architecture has attention code of its own: dense (every
# block) and MoD (attention over a block's routed tokens). MoE and hybrid blocks run those same attention paths
# with another MLP, so their copies of the matrix would re-run the same computations.
ATTENTION_COVERED_BY = {"moe": "dense", "moe_deepspeed": "dense", "hybrid": "dense and mod"}


class AdaptiveModelTester:
    """Shapes and inputs like transformers' CausalLMModelTester, for one architecture.

    intermediate_size is 32, not the tester's 37: Mixtral's default `grouped_mm` experts need 16-byte strides
    on CPU ("strides should be multiple of 16 bytes" otherwise), and the references must run.
    """

    def __init__(self, parent, arch: str, moe_implementation: str = "native", batch_size: int = 13,
                 seq_length: int = 7, vocab_size: int = 99, hidden_size: int = 32, num_attention_heads: int = 2,
                 num_key_value_heads: int = 2, intermediate_size: int = 32, is_training: bool = True):
        self.parent = parent
        self.arch, self.moe_implementation = arch, moe_implementation
        self.batch_size, self.seq_length, self.is_training = batch_size, seq_length, is_training
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers = len(BLOCKS[arch])
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.intermediate_size = intermediate_size
        self.base_model_class = AdaptiveModel

    def get_config(self) -> AdaptiveConfig:
        moe = any(t in ("moe", "hybrid") for t in BLOCKS[self.arch])
        return AdaptiveConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, block_types=BLOCKS[self.arch],
            max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            num_local_experts=4 if moe else 0, num_experts_per_tok=2 if moe else 0,
            moe_intermediate_size=12 if moe else 0, moe_implementation=self.moe_implementation,
            mod_capacity=0.5,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = torch.tril(torch.ones_like(input_ids))  # as CausalLMModelTester: rows of different lengths
        return self.get_config(), {"input_ids": input_ids, "attention_mask": mask}


class ReferenceModelTester(AdaptiveModelTester):
    """The same shapes for transformers' Llama (dense) and Mixtral (moe)."""

    def get_config(self):
        shape = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, max_position_embeddings=512, pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
        )
        if self.arch == "moe":
            self.base_model_class = MixtralModel
            return MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
        self.base_model_class = LlamaModel
        return LlamaConfig(**shape)


class _HarnessBase(unittest.TestCase):
    # transformers' static Auto-class name tables decide which classes get labels (`_prepare_for_class`) and
    # which are base models that have no loss (`test_training`). An in-library model is listed there; ours is
    # registered at runtime instead, so each test lists it for its own duration.
    def setUp(self):
        super().setUp()
        for table, name in ((modeling_auto.MODEL_MAPPING_NAMES, "AdaptiveModel"),
                            (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "AdaptiveForCausalLM")):
            patcher = mock.patch.dict(table, {"adaptive": name})
            patcher.start()
            self.addCleanup(patcher.stop)


def make_test_class(name: str, arch: str, moe_implementation: str = "native", reference: bool = False):
    config_class = (MixtralConfig if arch == "moe" else LlamaConfig) if reference else AdaptiveConfig
    if reference:
        classes = (MixtralModel, MixtralForCausalLM) if arch == "moe" else (LlamaModel, LlamaForCausalLM)
    else:
        classes = (AdaptiveModel, AdaptiveForCausalLM)
    tester = ReferenceModelTester if reference else AdaptiveModelTester

    class Test(common.ModelTesterMixin, _HarnessBase):
        all_model_classes = classes
        # transformers' GenerationTesterMixin is not in the sdist; test_generation_modes.py covers generation
        all_generative_model_classes = ()
        expected_failures = EXPECTED_FAILURES.get(name, {})

        def setUp(self):
            super().setUp()
            self.model_tester = tester(self, arch, moe_implementation)
            # a shape every config accepts (Llama's 32 default heads reject hidden 37; ours wants an even head_dim)
            self.config_tester = configuration.ConfigTester(self, config_class=config_class, hidden_size=40,
                                                            num_attention_heads=4)

        def test_config(self):
            self.config_tester.run_common_tests()

    for test_name, reason in SKIPPED_BY_DEFINITION.get(name, {}).items():
        setattr(Test, test_name, unittest.skip(reason)(lambda self: None))
    if name in ATTENTION_COVERED_BY:
        reason = f"the same attention paths run in the {ATTENTION_COVERED_BY[name]} classes' eager-vs-SDPA tests"
        for test_name in dir(common.ModelTesterMixin):
            if test_name.startswith("test_eager_matches_sdpa_inference"):
                setattr(Test, test_name, unittest.skip(reason)(lambda self: None))
    Test.__name__ = Test.__qualname__ = f"Test{name.title().replace('_', '')}Common"
    return Test
