"""The RULER generation budgets: the length-budget refusal, and when a short budget is escalated to the full one."""

from __future__ import annotations


from hf_posext.card.budgets import check_length_budget, first_budget, needs_full_budget


def test_over_budget_lengths_are_refused_in_one_line():
    assert check_length_budget("r", "t", 4096, 4000, 96, 4096, 4096) is None
    harness = check_length_budget("r", "niah_single_1", 4096, 4000, 128, 8192, 4096)
    assert "max_length 4096" in harness and "\n" not in harness
    window = check_length_budget("base, unscaled", "niah_single_1", 16384, 16250, 128, 8192, 16384)
    assert "window 8192" in window and "\n" not in window


def test_short_budget_is_escalated_exactly_when_it_could_change_the_score():
    assert not needs_full_budget(1.0, 24, 24, 128)  # already right: a longer output only adds text
    assert not needs_full_budget(0.0, 9, 24, 128)  # stopped before the budget: the full one stops there too
    assert needs_full_budget(0.0, 24, 24, 128) and needs_full_budget(0.5, 24, 24, 128)
    assert not needs_full_budget(0.0, 128, 128, 128)


def test_a_cell_starts_with_the_full_budget_once_generating_again_costs_more_than_the_short_one_saves():
    """Short first while generating again is rare or cheap (a short prompt); the full budget at once where one more
    prefill of a long prompt costs more than the decode steps the short budget saves (measured on 2 CPU cores at
    32768 tokens: 560 s of prefill against 19 s for 128 steps)."""
    def record(prefill, step, escalated, tokens=24):
        return {"timing": {"prefill_s": prefill, "generate_s": step * (tokens - 1)}, "generated_tokens": tokens,
                "escalated": escalated}

    assert first_budget([], 24, 128) == 24  # nothing measured yet
    assert first_budget([record(560.0, 0.15, True)], 24, 128) == 128
    # one success only: still (0 + 1) / (1 + 2) = 1/3 expected again, and 1/3 of 579 s is far above 15.6 s saved
    assert first_budget([record(560.0, 0.15, False)], 24, 128) == 128
    short_prompt = [record(1.0, 0.05, False), record(1.0, 0.05, False), record(1.0, 0.05, True)]
    assert first_budget(short_prompt, 24, 128) == 24  # 0.4 x 7.4 s < 5.2 s saved
    assert first_budget(short_prompt + [record(1.0, 0.05, True)] * 7, 24, 128) == 128  # 0.75 x 7.4 s > 5.2 s
    assert first_budget([record(560.0, 0.15, True)], 128, 128) == 128 and first_budget([], 200, 128) == 128
