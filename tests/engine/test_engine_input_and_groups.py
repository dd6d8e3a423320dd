"""Token ids beyond int64 are bad input (TokenOutOfVocab), not a conversion failure; lattice
groups take the world's collective timeout rather than torch's 30-minute gloo default."""

from __future__ import annotations

import pytest
import torch
from engine_dist import run_world
from engine_rank_cases import group_timeouts

from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.errors import TokenOutOfVocab
from services.rankd.engine.model import Qwen3ForCausalLM
from shared.ids import InvalidInput

CFG = Qwen3Config(
    vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def model() -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.random(CFG, seed=0)


@pytest.mark.parametrize("bad", [256, 2**63 - 1, 2**63, 2**70, -1, -(2**64)])
def test_an_id_outside_the_vocabulary_is_token_out_of_vocab_whatever_its_size(
    model: Qwen3ForCausalLM, bad: int
) -> None:
    # A list reaches the check as given (RankEngine.prefill): an id no int64 holds must not
    # escape as torch's ValueError (Overflow), which a rank reports as a world failure.
    with pytest.raises(TokenOutOfVocab):
        model.check_request([1, 2, bad])
    with pytest.raises(TokenOutOfVocab):
        model.check_request((bad,))


def test_non_integer_ids_are_still_invalid_input(model: Qwen3ForCausalLM) -> None:
    for bad in ([1.5], [[1, 2]], [], ["a"]):
        with pytest.raises(InvalidInput):
            model.check_request(bad)  # type: ignore[arg-type]
    assert model.check_request([0, 255]).tolist() == [0, 255]
    assert model.check_request(torch.tensor([3])).dtype == torch.int64


def test_lattice_groups_use_the_given_collective_timeout() -> None:
    # The default group was made with 120 s (engine_dist); new_group inherits neither that
    # nor anything else unless passed: without it gloo groups wait 30 min for a member.
    assert run_world(group_timeouts, 2, 42.0) == [{2: 42.0}, {2: 42.0}]
