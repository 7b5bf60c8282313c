#!/usr/bin/env node
// CartPole-v1 written in JavaScript, trained by a kuberl actor over the Actor.EnvSession stream.
//
//   node cartpole.js --actor HOST:PORT --envs N --steps S [--session ID] [--seed K] [--hide-velocity]
//
// --hide-velocity observes only the cart's position and the pole's angle ([N, 2]: the task needs
// memory, kuberl_envs' CartPoleNoVelocity-v1): train it with a recurrent policy,
// configs/cartpole_novelocity_external.yaml (docs/recurrent.md).
// The simulator steps N copies of CartPole in lockstep. Every lockstep step it sends the actor one
// EnvStep (observations, and the rewards / terminated / truncated flags of the previous actions)
// and gets back one action per copy. It resets copies whose episode ended itself, in the same step
// (the step carries the reset observation, the true last one goes in final_observations). After S
// steps it sends the last rewards, half-closes the stream and exits 0 once the actor has closed it.
// Every --reconnect-every seconds (240) it hands the session over to a new stream on a new connection
// (the actor's server ends connections after about 5 minutes); the actor resumes the session.
// On a gRPC error it prints the status and exits 1.
//
// Every ~5 s it prints the steps done and the mean return of the last 100 episodes; at the end one
// JSON line: {"steps", "env_steps", "episodes", "mean_return_first_100", "mean_return_last_100", ...}.
//
// The protocol is documented in protos/kuberl/v1/actor.proto and docs/external-simulators.md; the
// session code shared with the other Node.js example is ../node-common/envsession.js.
'use strict';

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { DTYPE_FLOAT32, decodeDiscrete, rng, runSimulator, tensor } = require('../node-common/envsession');

// ---- CartPole-v1, as in gymnasium (classic_control/cartpole.py with its TimeLimit of 500) ----------

const GRAVITY = 9.8;
const MASSCART = 1.0;
const MASSPOLE = 0.1;
const TOTAL_MASS = MASSPOLE + MASSCART;
const LENGTH = 0.5; // half the pole's length
const POLEMASS_LENGTH = MASSPOLE * LENGTH;
const FORCE_MAG = 10.0;
const TAU = 0.02; // seconds between state updates (euler integration)
const THETA_THRESHOLD = (12 * 2 * Math.PI) / 360; // 12 degrees
const X_THRESHOLD = 2.4;
const MAX_EPISODE_STEPS = 500;
const STATE_DIM = 4; // x, x_dot, theta, theta_dot
// What the simulator shows: the whole state, or (--hide-velocity) x and theta only.
const HIDE_VELOCITY = process.argv.includes('--hide-velocity');
if (HIDE_VELOCITY) process.argv.splice(process.argv.indexOf('--hide-velocity'), 1);
const SHOWN = HIDE_VELOCITY ? [0, 2] : [0, 1, 2, 3];
const OBS_DIM = SHOWN.length;
const NUM_ACTIONS = 2; // 0 push left, 1 push right

// N copies stepped in lockstep. State in float64 (as gymnasium), observations handed out as float32.
class CartPoleVec {
  constructor(numEnvs, seed) {
    this.n = numEnvs;
    this.random = rng(seed);
    this.state = new Float64Array(numEnvs * STATE_DIM);
    this.elapsed = new Int32Array(numEnvs);
    for (let i = 0; i < numEnvs; i++) this.reset(i);
  }

  reset(i) {
    for (let k = 0; k < STATE_DIM; k++) this.state[i * STATE_DIM + k] = this.random() * 0.1 - 0.05; // U(-0.05, 0.05)
    this.elapsed[i] = 0;
  }

  // Writes env i's observation into out (a Float32Array) at row `row`.
  observe(i, out, row) {
    for (let k = 0; k < OBS_DIM; k++) out[row * OBS_DIM + k] = this.state[i * STATE_DIM + SHOWN[k]];
  }

  // One step of env i; returns [reward, terminated, truncated].
  stepOne(i, action) {
    const s = this.state;
    const o = i * STATE_DIM;
    const x = s[o];
    const xDot = s[o + 1];
    const theta = s[o + 2];
    const thetaDot = s[o + 3];
    const force = action === 1 ? FORCE_MAG : -FORCE_MAG;
    const cosTheta = Math.cos(theta);
    const sinTheta = Math.sin(theta);
    // Same operation order as gymnasium, so results agree to the last bit (given equal sin/cos).
    const temp = (force + POLEMASS_LENGTH * (thetaDot * thetaDot) * sinTheta) / TOTAL_MASS;
    const thetaAcc = (GRAVITY * sinTheta - cosTheta * temp) /
      (LENGTH * (4.0 / 3.0 - (MASSPOLE * (cosTheta * cosTheta)) / TOTAL_MASS));
    const xAcc = temp - (POLEMASS_LENGTH * thetaAcc * cosTheta) / TOTAL_MASS;
    s[o] = x + TAU * xDot;
    s[o + 1] = xDot + TAU * xAcc;
    s[o + 2] = theta + TAU * thetaDot;
    s[o + 3] = thetaDot + TAU * thetaAcc;
    this.elapsed[i] += 1;
    const terminated = s[o] < -X_THRESHOLD || s[o] > X_THRESHOLD ||
      s[o + 2] < -THETA_THRESHOLD || s[o + 2] > THETA_THRESHOLD;
    const truncated = this.elapsed[i] >= MAX_EPISODE_STEPS;
    return [1.0, terminated, truncated];
  }

  // The observations of every copy: [N, OBS_DIM] float32.
  observations() {
    const obs = new Float32Array(this.n * OBS_DIM);
    for (let i = 0; i < this.n; i++) this.observe(i, obs, i);
    return obs;
  }
}

// ---- the session ---------------------------------------------------------------------------------

function decodeActions(t, numEnvs) {
  return decodeDiscrete(t, numEnvs, NUM_ACTIONS);
}

if (require.main === module) {
  runSimulator({ grpc, protoLoader }, {
    name: 'node-cartpole',
    script: 'cartpole.js',
    observationSpace: { box: { shape: [OBS_DIM], dtype: DTYPE_FLOAT32 } },
    actionSpace: { discrete: { n: NUM_ACTIONS } },
    obsDim: OBS_DIM,
    make: (numEnvs, seed) => new CartPoleVec(numEnvs, seed),
    decodeActions,
  });
} else {
  module.exports = { CartPoleVec, decodeActions, tensor }; // for checks against gymnasium
}
