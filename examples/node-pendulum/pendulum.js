#!/usr/bin/env node
// Pendulum-v1 written in JavaScript: a continuous action (one torque in [-2, 2]) trained by a kuberl
// actor over the Actor.EnvSession stream.
//
//   node pendulum.js --actor HOST:PORT --envs N --steps S [--session ID] [--seed K]
//
// The hello declares observation_space Box [3] float32 (cos theta, sin theta, angular velocity) and
// action_space Box [1] float32 with low [-2] and high [2]; the actor answers every step with
// [N, 1] float32 torques, already clipped to those bounds. Episodes are truncated after 200 steps
// (never terminated: there is no failure state), so the learner bootstraps from the last observation.
// Everything else (handovers, progress lines, the final JSON line, exit codes) is as in
// ../node-cartpole/cartpole.js; the session code the two share is ../node-common/envsession.js.
// Run it against `kuberl up configs/pendulum_external.yaml` (README.md here).
'use strict';

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { DTYPE_FLOAT32, decodeBox, rng, runSimulator } = require('../node-common/envsession');

// ---- Pendulum-v1, as in gymnasium (classic_control/pendulum.py with its TimeLimit of 200) ---------

const MAX_SPEED = 8;
const MAX_TORQUE = 2.0;
const DT = 0.05;
const G = 10.0;
const M = 1.0;
const L = 1.0;
const MAX_EPISODE_STEPS = 200;
const OBS_DIM = 3;

// Python's ((x + pi) % (2 pi)) - pi: the angle in [-pi, pi) (JS's % keeps the sign of x; this does not).
function angleNormalize(x) {
  const twoPi = 2 * Math.PI;
  return ((((x + Math.PI) % twoPi) + twoPi) % twoPi) - Math.PI;
}

// N pendulums stepped in lockstep. State (theta, theta_dot) in float64, observations as float32.
class PendulumVec {
  constructor(numEnvs, seed) {
    this.n = numEnvs;
    this.random = rng(seed);
    this.theta = new Float64Array(numEnvs);
    this.thetaDot = new Float64Array(numEnvs);
    this.elapsed = new Int32Array(numEnvs);
    for (let i = 0; i < numEnvs; i++) this.reset(i);
  }

  reset(i) {
    this.theta[i] = (this.random() * 2 - 1) * Math.PI; // U(-pi, pi)
    this.thetaDot[i] = this.random() * 2 - 1; // U(-1, 1)
    this.elapsed[i] = 0;
  }

  // Writes env i's observation into out (a Float32Array) at row `row`.
  observe(i, out, row) {
    out[row * OBS_DIM] = Math.cos(this.theta[i]);
    out[row * OBS_DIM + 1] = Math.sin(this.theta[i]);
    out[row * OBS_DIM + 2] = this.thetaDot[i];
  }

  // One step of env i with torque action[0]; returns [reward, terminated, truncated].
  stepOne(i, action) {
    const th = this.theta[i];
    const thdot = this.thetaDot[i];
    const u = Math.min(MAX_TORQUE, Math.max(-MAX_TORQUE, action[0]));
    const costs = angleNormalize(th) ** 2 + 0.1 * thdot ** 2 + 0.001 * u ** 2;
    let newThdot = thdot + ((3 * G) / (2 * L) * Math.sin(th) + (3.0 / (M * L ** 2)) * u) * DT;
    newThdot = Math.min(MAX_SPEED, Math.max(-MAX_SPEED, newThdot));
    this.theta[i] = th + newThdot * DT;
    this.thetaDot[i] = newThdot;
    this.elapsed[i] += 1;
    return [-costs, false, this.elapsed[i] >= MAX_EPISODE_STEPS];
  }

  // The observations of every copy: [N, 3] float32.
  observations() {
    const obs = new Float32Array(this.n * OBS_DIM);
    for (let i = 0; i < this.n; i++) this.observe(i, obs, i);
    return obs;
  }
}

function decodeActions(t, numEnvs) {
  return decodeBox(t, numEnvs, 1, -MAX_TORQUE, MAX_TORQUE);
}

if (require.main === module) {
  runSimulator({ grpc, protoLoader }, {
    name: 'node-pendulum',
    script: 'pendulum.js',
    observationSpace: { box: { shape: [OBS_DIM], dtype: DTYPE_FLOAT32 } },
    // Box bounds: one value applies to every element (here the only one).
    actionSpace: { box: { shape: [1], dtype: DTYPE_FLOAT32, low: [-MAX_TORQUE], high: [MAX_TORQUE] } },
    obsDim: OBS_DIM,
    make: (numEnvs, seed) => new PendulumVec(numEnvs, seed),
    decodeActions,
  });
} else {
  module.exports = { PendulumVec, angleNormalize, decodeActions }; // for checks against gymnasium
}
