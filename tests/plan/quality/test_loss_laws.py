"""Each law's arithmetic against figures printed in its paper (or its authors' published analysis)."""

from __future__ import annotations

import pytest

from adaptive.plan.quality import hyperparams, repeated_data
from adaptive.plan.quality.laws import CHINCHILLA, EPOCH, JOINT_MOE, DenseLaw

GOPHER_FLOPS = 5.76e23  # Hoffmann et al. 2022, appendix F


def test_chinchilla_coefficients_round_to_the_printed_ones():
    # the paper prints E 1.69, A 406.4, B 410.7, alpha 0.34, beta 0.28 (appendix D.2)
    assert (round(CHINCHILLA.E, 2), round(CHINCHILLA.A, 1), round(CHINCHILLA.B, 1)) == (1.69, 406.4, 410.7)
    assert (round(CHINCHILLA.alpha, 2), round(CHINCHILLA.beta, 2)) == (0.34, 0.28)


def test_chinchilla_reproduces_the_papers_own_figures():
    # Table 2: approach 3 gives N_opt ~ C^0.46 and D_opt ~ C^0.54
    a = CHINCHILLA.beta / (CHINCHILLA.alpha + CHINCHILLA.beta)
    assert round(a, 2) == 0.46 and round(1 - a, 2) == 0.54
    # Figure 4: "We project the optimal model size given the Gopher FLOP budget to be 40B parameters"
    n, d = CHINCHILLA.optimal_split(GOPHER_FLOPS)
    assert n == pytest.approx(40e9, rel=0.02)
    assert 6 * n * d == pytest.approx(GOPHER_FLOPS)


def test_the_rounded_chinchilla_fit_does_not_reproduce_them():
    """Why we take the TeX source's values (Besiroglu et al. 2024): the printed rounding moves the optimum."""
    rounded = DenseLaw("rounded", 1.69, 406.4, 410.7, 0.34, 0.28, source="", fitted_on="")
    n, _ = rounded.optimal_split(GOPHER_FLOPS)
    assert n == pytest.approx(32e9, rel=0.02)  # not 40B
    assert round(rounded.beta / (rounded.alpha + rounded.beta), 2) == 0.45  # not 0.46


def test_epoch_refit():
    # Besiroglu et al. 2024: a = beta / (alpha + beta) = 0.513 (their analysis), ~20 tokens per parameter at the
    # optimum, consistent with Chinchilla's approaches 1 and 2 (the original approach-3 fit gives ~70 near there)
    assert EPOCH.beta / (EPOCH.alpha + EPOCH.beta) == pytest.approx(0.513, abs=0.001)
    chinchilla_flops = 6 * 70e9 * 1.4e12
    n, d = EPOCH.optimal_split(chinchilla_flops)
    assert 15 < d / n < 25
    n0, d0 = CHINCHILLA.optimal_split(chinchilla_flops)
    assert d0 / n0 > 50


# Ludziejewski et al. 2025, Table 4: the joint law at fixed E, reduced to m N^mu + n D^nu + c
TABLE_4 = {1: (30.3640, -0.1817, 53.9838, -0.1965), 2: (27.7982, -0.1780, 66.8401, -0.2065),
           4: (24.8462, -0.1731, 87.7022, -0.2192), 8: (21.8330, -0.1676, 119.9126, -0.2338),
           16: (19.0159, -0.1617, 167.5073, -0.2494), 32: (16.5424, -0.1557, 234.6726, -0.2652)}


@pytest.mark.parametrize("experts", sorted(TABLE_4))
def test_joint_moe_law_reduces_to_table_4(experts):
    m, mu, n, nu = JOINT_MOE.reduced(experts)
    tm, tmu, tn, tnu = TABLE_4[experts]
    assert m == pytest.approx(tm, rel=0.005) and n == pytest.approx(tn, rel=0.005)
    assert mu == pytest.approx(tmu, abs=0.0002) and nu == pytest.approx(tnu, abs=0.0002)


# Table 1: compute-optimal (N_act, D) per budget and expert count
TABLE_1 = {(1e20, 1): (1.7e9, 9.7e9), (1e20, 8): (990e6, 17e9), (1e20, 32): (669e6, 24.9e9),
           (1e21, 1): (5.7e9, 29.3e9), (1e21, 4): (4.4e9, 38e9), (1e22, 16): (13.2e9, 126.5e9),
           (1e22, 32): (12.2e9, 136.9e9)}


@pytest.mark.parametrize("budget,experts", sorted(TABLE_1))
def test_joint_moe_law_compute_optima_match_table_1(budget, experts):
    n, d = JOINT_MOE.optimal_split(budget, experts)
    tn, td = TABLE_1[budget, experts]
    assert n == pytest.approx(tn, rel=0.03) and d == pytest.approx(td, rel=0.03)


def test_transformed_expert_count_is_e_start_for_a_dense_model_and_saturates():
    assert JOINT_MOE.transformed_experts(1) == pytest.approx(JOINT_MOE.e_start)
    assert JOINT_MOE.transformed_experts(1e9) == pytest.approx(JOINT_MOE.e_max, rel=1e-6)


def test_more_experts_lower_the_loss_at_the_same_active_size():
    losses = [JOINT_MOE.loss(1e9, 20e9, e) for e in (1, 2, 4, 8, 16, 32)]
    assert losses == sorted(losses, reverse=True)


def test_muennighoff_law_reproduces_the_authors_figures():
    # github.com/huggingface/datablations README, "Parametric Fit": scaling_law(6.34e9, 242e9, 25e9) and (8.67e9, ...)
    from adaptive.plan.quality.repeated_data import MUENNIGHOFF

    assert MUENNIGHOFF.loss(6.34e9, 242e9, 25e9) == pytest.approx(2.2256440889984477, rel=1e-9)
    assert MUENNIGHOFF.loss(8.67e9, 178e9, 25e9) == pytest.approx(2.2269634075087867, rel=1e-9)


def test_repeated_data_is_nearly_free_for_four_epochs_and_saturates():
    u = 10e9
    assert repeated_data.effective_tokens(u, u) == u
    assert repeated_data.effective_tokens(4 * u, u) / (4 * u) > 0.93  # "up to 4 epochs ... negligible changes"
    # past many repeats, more epochs buy almost nothing: the limit is U (1 + R_D*)
    assert repeated_data.effective_tokens(1000 * u, u) == pytest.approx(u * (1 + repeated_data.R_D_STAR), rel=1e-6)
    assert repeated_data.effective_tokens(5e9, None) == 5e9


def test_deepseek_hyperparameters_reproduce_their_table_2():
    """DeepSeek LLM 7B (30 layers, width 4096, sequence 4096, 2T tokens): batch 2304 sequences, lr 4.2e-4; 67B
    (95 layers, 8192): 4608 sequences, 3.2e-4. M = 72 n_layer d^2 + 12 n_layer d l_seq (their section 3.1)."""
    for layers, width, batch, lr in ((30, 4096, 2304, 4.2e-4), (95, 8192, 4608, 3.2e-4)):
        m = 72 * layers * width**2 + 12 * layers * width * 4096
        h = hyperparams.compute_optimal(m, 2e12)
        assert h.lr == pytest.approx(lr, rel=0.03)
        assert h.global_batch_tokens / 4096 == pytest.approx(batch, rel=0.1)
        assert h.extrapolated  # fitted from 1e17 to 2e19 FLOPs
    assert not hyperparams.compute_optimal(1e9, 1e9).extrapolated  # C = 1e18 lies in the fitted 1e17-2e19
