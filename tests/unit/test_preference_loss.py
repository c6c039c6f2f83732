"""The preference objectives' formulas (model/preference_loss.py), against values worked out with the
math module, and the properties their papers state."""

from __future__ import annotations

import math

import pytest
import torch

from elastictrain.model.preference_loss import dpo, kto, orpo, simpo

T = torch.tensor


def logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_dpo_before_the_first_update_is_exactly_ln_2():
    logps = T([-12.5, -3.25], dtype=torch.float64)
    out = dpo(logps, logps - 1, logps, logps - 1, beta=0.1)  # policy == reference
    assert torch.equal(out.losses, torch.full((2,), math.log(2), dtype=torch.float64))
    assert torch.equal(out.chosen_rewards, torch.zeros(2, dtype=torch.float64))


def test_dpo_sigmoid_hinge_and_conservative_dpo_match_their_formulas():
    c, r, rc, rr = T([-10.0]), T([-14.0]), T([-11.0]), T([-13.0])  # margin (1) - (-1) = 2
    beta = 0.1
    m = (-10 + 11) - (-14 + 13)
    assert dpo(c, r, rc, rr, beta=beta).losses.item() == pytest.approx(-logsigmoid(beta * m), rel=1e-6)
    assert dpo(c, r, rc, rr, beta=beta, loss="hinge").losses.item() == pytest.approx(1 - beta * m, rel=1e-6)
    want = -0.8 * logsigmoid(beta * m) - 0.2 * logsigmoid(-beta * m)
    assert dpo(c, r, rc, rr, beta=beta, label_smoothing=0.2).losses.item() == pytest.approx(want, rel=1e-6)
    out = dpo(c, r, rc, rr, beta=beta)
    assert out.chosen_rewards.item() == pytest.approx(0.1) and out.rejected_rewards.item() == pytest.approx(
        -0.1
    )


def test_ipo_uses_mean_log_probabilities_and_is_zero_at_its_target_margin():
    beta = 0.5
    tokens = T([4.0])
    # mean log-ratios: chosen +1/4 x 4 ... a margin of exactly 1 / (2 beta) = 1 on the means
    c, r = T([-8.0]), T([-12.0])
    assert (
        dpo(
            c, r, T([-8.0]), T([-8.0]), beta=beta, loss="ipo", chosen_tokens=tokens, rejected_tokens=tokens
        ).losses.item()
        == 0
    )
    with pytest.raises(ValueError, match="chosen_tokens"):
        dpo(c, r, c, r, loss="ipo")
    with pytest.raises(ValueError, match="expected one of sigmoid, hinge, ipo"):
        dpo(c, r, c, r, loss="bco")


def test_a_higher_chosen_log_probability_lowers_every_dpo_loss():
    for loss in ("sigmoid", "hinge", "ipo"):
        c = T([-10.0], requires_grad=True)
        out = dpo(
            c,
            T([-9.0]),
            T([-10.0]),
            T([-9.0]),
            beta=0.1,
            loss=loss,
            chosen_tokens=T([5.0]),
            rejected_tokens=T([5.0]),
        )
        out.losses.sum().backward()
        assert c.grad is not None and c.grad.item() < 0, loss


def test_simpo_is_reference_free_length_normalised_with_its_margin():
    c, r, nc, nr = T([-6.0]), T([-12.0]), T([3.0]), T([4.0])  # means -2 and -3
    beta, gamma = 2.0, 0.5
    want = -logsigmoid(beta * (-2 + 3) - gamma)
    assert simpo(c, r, nc, nr, beta=beta, gamma=gamma).losses.item() == pytest.approx(want, rel=1e-6)


def test_orpo_is_the_chosen_nll_minus_beta_log_sigmoid_of_the_log_odds_ratio():
    c, r, nc, nr = T([-2.0], dtype=torch.float64), T([-6.0], dtype=torch.float64), T([4.0]), T([3.0])
    pc, pr = math.exp(-0.5), math.exp(-2.0)  # mean token probabilities
    log_odds = math.log(pc / (1 - pc)) - math.log(pr / (1 - pr))
    want = 0.5 - 0.1 * logsigmoid(log_odds)
    assert orpo(c, r, nc, nr, beta=0.1).losses.item() == pytest.approx(want, rel=1e-12)


def test_kto_weighs_desirable_and_undesirable_answers_against_the_kl_estimate():
    logps, ref = T([-5.0, -5.0]), T([-6.0, -4.0])  # log-ratios +1 and -1
    desirable = T([True, False])
    out = kto(logps, ref, desirable, kl=T(0.25), beta=0.1, desirable_weight=1.0, undesirable_weight=1.5)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert out.losses.tolist() == pytest.approx(
        [1 - sig(0.1 * (1 - 0.25)), 1.5 * (1 - sig(0.1 * (0.25 + 1)))]
    )
    clamped = kto(logps, ref, desirable, kl=T(-3.0), beta=0.1)  # a negative KL estimate counts as 0
    assert clamped.losses[0].item() == pytest.approx(1 - sig(0.1))
    assert out.chosen_rewards.tolist() == pytest.approx([0.1, 0.0])
    assert out.rejected_rewards.tolist() == pytest.approx([0.0, -0.1])
