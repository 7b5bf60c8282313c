"""PPO's settings: the `ppo` section of the experiment config."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import require


@dataclass(frozen=True)
class PPOConfig:
    """PPO (clipped objective, GAE), as in CleanRL's ppo.py; a batch is whole fragments."""
    rollout_steps: int = 64           # T: steps per env in one fragment
    batch_steps: int = 512            # steps per learner batch (whole fragments, at least this many)
    # SB3's default number of epochs; bench/zoo.py: 4 left CartPole short of 475 in 100k steps and took
    # Acrobot 63k steps to -100, 10 took 46.8k.
    num_epochs: int = 10              # passes over each batch
    num_minibatches: int = 4          # minibatches per epoch
    learning_rate: float = 1e-3       # Adam's step size (falls linearly to 0 over anneal_updates when that is set)
    gamma: float = 0.99               # discount factor
    gae_lambda: float = 0.95          # GAE's lambda (Schulman et al. 2016): 0 = one-step TD errors, 1 = Monte Carlo returns
    clip_coef: float = 0.2            # clip range epsilon: the probability ratio pi/pi_old is clipped to 1 +- clip_coef
    clip_vloss: bool = True           # clip the value loss too: the larger squared error of the new value and of the old
    #                                   value moved by at most clip_coef (CleanRL's clip_vloss)
    ent_coef: float = 0.0             # weight of the entropy bonus in the loss
    vf_coef: float = 0.5              # weight of the value loss in the loss
    max_grad_norm: float = 0.5        # gradients are clipped to this global L2 norm
    norm_adv: bool = True             # normalise advantages to mean 0 and std 1 within each minibatch
    hidden_sizes: tuple[int, ...] = (64, 64)  # hidden layer widths of the policy and value MLPs (flat observations)
    # Staleness bound (docs/architecture.md section 4), the one max_policy_lag: a fragment whose
    # policy_version is more than this many learner updates (batches) behind when it is consumed is stale.
    # None = no bound; 0 = only fragments of the current policy. The learner applies it to what it
    # consumes (stale_fragments below); with "drop" the buffer reads it too (FifoTable) and drops such
    # fragments before serving them. (The planner's target for the mean lag is planner.staleness_target.)
    max_policy_lag: int | None = 8    # a fragment more than this many updates behind is stale (null: no bound)
    # What happens to stale fragments: "correct" (trained on with V-trace targets and truncated
    # importance weights, Espeholt et al. 2018) or "drop" (counted, never trained on). docs/staleness.md
    # measured correct reaching a return of 475 on CartPole in 6.8 s against 9.8 s for drop.
    stale_fragments: str = "correct"  # stale fragments are trained on with V-trace (correct) or counted and dropped (drop)
    vtrace_rho_bar: float = 1.0       # V-trace on stale fragments: the importance weight rho = pi/mu is truncated here
    vtrace_c_bar: float = 1.0         # V-trace on stale fragments: the trace-cutting weight c is truncated here
    # The decoupled objective (Hilton et al. 2021, "Batch size-invariance for policy optimization"):
    # the clip is centred on the policy at the start of the update (pi_prox), not on the behaviour
    # policy mu that acted, and each sample's term is weighted by pi_prox/mu, truncated at
    # decoupled_rho_bar. On-policy data (mu = pi_prox) trains as plain PPO; data a version or more
    # behind (asynchronous actors: the rate limiter keeps them about one batch ahead, a lag of 1)
    # does not start its update already outside the clip. bench/zoo.py, 2026-11-26, env steps to
    # the target, seeds 0/1, plain -> decoupled: defaults Acrobot 20,960/18,224 -> 19,832/14,672,
    # CartPole 63,464/64,904 -> 62,192/62,976; the zoo's Acrobot settings unpaced (lag 1)
    # 107,168 and 121,744/110,592 -> 114,560/71,920 (a synchronous loop at lag 1, 6 seeds: mean 126k -> 97k).
    decoupled: bool = True            # decoupled objective (Hilton et al. 2021): clip around the policy at the start of
    #                                   the update (pi_prox), not the acting one (mu); weight each sample by pi_prox/mu
    decoupled_rho_bar: float = 1.0    # truncation of each sample's weight pi_prox/mu in the decoupled objective
    # Rewards are multiplied by this before returns and advantages are computed (the episode returns
    # kuberl reports stay unscaled). Continuous-control rewards such as Pendulum's -16..0 give value
    # targets in the hundreds; a scale of 0.1 keeps them near 1, as SB3's VecNormalize does adaptively.
    reward_scale: float = 1.0         # rewards are multiplied by this before returns and advantages are computed
    # Observations normalised by a running mean and variance, clipped to +-obs_clip (gymnasium's
    # NormalizeObservation, SB3's VecNormalize), for flat (non-image) observations. The statistics
    # are buffers of the network: the learner updates them from every batch it trains on (summed over
    # a learner group) and they reach actors with the weights, so both normalise alike.
    normalize_observations: bool = False  # normalise flat observations by a running mean and std, clipped to +-obs_clip
    obs_clip: float = 10.0            # normalised observations are clipped to +-obs_clip
    # Rewards divided by the running standard deviation of each env's discounted return and clipped
    # to +-reward_clip before returns and advantages are computed (SB3's VecNormalize norm_reward,
    # gymnasium's NormalizeReward). The learner keeps the statistics (in its checkpoints) and each
    # env's running return across fragments; the episode returns kuberl reports stay unscaled. On by
    # default, as Sample Factory's normalize_returns: bench/zoo.py measured CartPole 92.2k/67.6k env
    # steps to 475 without it and 63.5k/60.5k with it, Acrobot 45.9k/38.9k and 24.1k/18.3k to -100.
    normalize_rewards: bool = True    # divide rewards by the running std of each env's discounted return, clip them
    #                                   to +-reward_clip (reported returns stay unscaled)
    reward_clip: float = 10.0         # rewards normalised by normalize_rewards are clipped to +-reward_clip
    # Linear annealing (CleanRL's anneal_lr, rl-baselines3-zoo's "lin_" schedules): the learning rate,
    # and the clip range where anneal_clip is set, fall linearly from their values above to 0 over
    # this many updates (batches; the learner's version), and stay at 0 after. None: constant.
    anneal_updates: int | None = None  # learner updates over which learning_rate (and clip_coef with anneal_clip) fall
    #                                    linearly to 0; null: constant
    anneal_clip: bool = False         # the clip range clip_coef falls to 0 too, with the learning rate (needs anneal_updates)
    # Memory (docs/recurrent.md): "lstm" or "gru" puts a recurrent core of recurrent_size units
    # between the torso (the MLP of hidden_sizes, or the Nature CNN) and both heads, as CleanRL's
    # ppo_atari_lstm.py and Sample Factory do. Actors carry its state per env, reset it where an
    # episode ends and send each fragment's starting state; the learner replays each env's sequence
    # from it (truncated back-propagation through the fragment), in minibatches of whole sequences.
    # None: feed-forward.
    recurrent: str | None = None      # lstm or gru: a recurrent core between torso and heads; null: feed-forward
    recurrent_size: int = 64          # units of the recurrent core
    # "shared": both heads read the one core; "separate": the value head reads a core of its own
    # (sb3-contrib's enable_critic_lstm), which doubles the state actors carry.
    critic_core: str = "shared"       # shared: both heads read one recurrent core; separate: the value head has its own

    def __post_init__(self) -> None:
        require(self.recurrent in (None, "lstm", "gru"), "recurrent", self.recurrent,
                "must be 'lstm', 'gru' or null (feed-forward)")
        require(self.recurrent_size >= 1, "recurrent_size", self.recurrent_size, "must be >= 1")
        require(self.critic_core in ("shared", "separate"), "critic_core", self.critic_core, "must be 'shared' or 'separate'")
        require(self.reward_scale > 0, "reward_scale", self.reward_scale, "must be > 0")
        require(self.obs_clip > 0, "obs_clip", self.obs_clip, "must be > 0")
        require(self.reward_clip > 0, "reward_clip", self.reward_clip, "must be > 0")
        require(self.max_policy_lag is None or self.max_policy_lag >= 0, "max_policy_lag", self.max_policy_lag,
                "must be >= 0 (0 = train only on fragments from the current policy), or null for no bound")
        require(self.stale_fragments in ("drop", "correct"), "stale_fragments", self.stale_fragments,
                "must be 'drop' or 'correct'")
        require(self.decoupled_rho_bar > 0, "decoupled_rho_bar", self.decoupled_rho_bar, "must be > 0")
        require(self.vtrace_rho_bar > 0 and self.vtrace_c_bar > 0, "vtrace_rho_bar",
                (self.vtrace_rho_bar, self.vtrace_c_bar), "V-trace truncation levels must be > 0")
        require(1 <= self.rollout_steps <= 65536, "rollout_steps", self.rollout_steps, "must be 1..65536")
        require(self.batch_steps >= 1, "batch_steps", self.batch_steps, "must be >= 1")
        require(self.num_epochs >= 1, "num_epochs", self.num_epochs, "must be >= 1")
        require(self.anneal_updates is None or self.anneal_updates >= 1, "anneal_updates", self.anneal_updates,
                "must be >= 1 (updates to anneal over), or null for constant rates")
        require(not self.anneal_clip or self.anneal_updates is not None, "anneal_clip", self.anneal_clip,
                "needs anneal_updates (the updates to anneal the clip range over)")
        require(1 <= self.num_minibatches <= self.batch_steps, "num_minibatches", self.num_minibatches,
                "must be 1..batch_steps, or minibatches would be empty")
        require(self.learning_rate > 0, "learning_rate", self.learning_rate, "must be > 0")
        require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        require(0 <= self.gae_lambda <= 1, "gae_lambda", self.gae_lambda, "must be in [0, 1]")
        require(self.clip_coef > 0, "clip_coef", self.clip_coef, "must be > 0")
        require(self.max_grad_norm > 0, "max_grad_norm", self.max_grad_norm, "must be > 0")
        require(all(h > 0 for h in self.hidden_sizes), "hidden_sizes", self.hidden_sizes,
                "every layer needs a positive width")
