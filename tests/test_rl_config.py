"""The rl config section: defaults, the rl_rewards syntax, and each mistake as one `error:` line with exit
status 2 through a tool's main(argv) (python -m k3jax.config)."""
import pytest

from k3jax import config as C
from k3jax.rl import rewards as R
from k3jax.validation import rl_reward_specs


def test_defaults_and_reward_specs():
    cfg = C.load(C.REPO_CONFIGS / "base.yml", [])
    assert cfg.rl.rl_num_generations == 4 and cfg.rl.rl_beta == 0.0 and cfg.rl.rl_loss_agg == "token_mean"
    assert (cfg.rl.rl_epsilon, cfg.rl.rl_epsilon_high) == (0.2, 0.28)      # DAPO's clip-higher
    cfg = C.load(C.REPO_CONFIGS / "base.yml", ["rl_rewards=exact_match=2,format=0.1,my.mod:fn"])
    assert rl_reward_specs(cfg.rl.rl_rewards) == [("exact_match", 2.0), ("format", 0.1), ("my.mod:fn", 1.0)]
    rs = R.RewardSet.from_config(C.load(C.REPO_CONFIGS / "base.yml", ["rl_rewards=tool_call=0.5,format",
                                                                       "rl_reward_errors=zero"]).rl)
    assert [(r.name, r.weight) for r in rs.rewards] == [("tool_call", 0.5), ("format", 1.0)] and rs.errors == "zero"


@pytest.mark.parametrize("arg,fragment", [
    ("rl_num_generations=1", "rl_num_generations=1: GRPO's advantages are relative to the group"),
    ("rl_num_iterations=0", "rl_num_iterations=0: must be >= 1"),
    ("rl_beta=-0.1", "rl_beta=-0.1: must be >= 0"),
    ("rl_epsilon=1.5", "rl_epsilon=1.5: must be in (0, 1)"),
    ("rl_epsilon_high=0", "rl_epsilon_high=0.0: must be > 0"),
    ("rl_tis_cap=0.5", "rl_tis_cap=0.5: must be 0 (off) or >= 1"),
    ("rl_loss_agg=sum", "rl_loss_agg='sum': must be one of token_mean, seq_mean_token_mean, seq_mean_token_sum_norm"),
    ("rl_objective=ppo", "rl_objective='ppo': must be one of grpo, gspo, gspo_token"),
    ("rl_advantage=rloo", "rl_advantage='rloo': must be one of grpo, dr_grpo"),
    ("rl_rewards=[]", "rl_rewards=[]: give at least one reward"),
    ("rl_rewards=exact_match=high", "rl_rewards entry 'exact_match=high': the weight 'high' after '=' is not a number"),
    ("rl_rewards=a:b:c", "rl_rewards entry 'a:b:c': a user reward is module:function (one ':')"),
    ("rl_reward_errors=ignore", "rl_reward_errors='ignore': must be one of raise, zero"),
    ("rl_temperature=0", "rl_temperature=0.0: must be > 0"),
    ("rl_top_p=0", "rl_top_p=0.0: must be in (0, 1]"),
    ("rl_max_turns=0", "rl_max_turns=0: must be >= 1"),
    ("rl_num_generation=8", "unknown config key 'rl_num_generation' (command line); did you mean 'rl_num_generations'"),
])
def test_mistakes_are_one_error_line_and_exit_2(capsys, arg, fragment):
    assert C.main([str(C.REPO_CONFIGS / "base.yml"), arg]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and fragment in err and "\n" not in err, err
