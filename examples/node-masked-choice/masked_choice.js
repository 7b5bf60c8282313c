#!/usr/bin/env node
// MaskedChoice in JavaScript: MultiDiscrete actions under per-step action masks, trained by a kuberl
// actor over the Actor.EnvSession stream (the same task as kuberl_envs' MaskedChoice-v0).
//
//   node masked_choice.js --actor HOST:PORT --envs N --steps S [--session ID] [--seed K]
//
// Each step shows a target value for each of two choices (4 and 3 values; the observation is their
// one-hots side by side, float32 [7]) and allows the target and each other value with probability
// 1/2. The step's EnvStep carries those allowed values in action_masks ([N, 7] bool: choice 0's four
// columns, then choice 1's three). The actor answers [N, 2] int64. A choice equal to its target earns
// 0.5; a disallowed value ends the episode (terminated) with -5; episodes last 16 steps (truncated),
// so the best return is 16, and a policy picking uniformly among the allowed values gets about 7.
// The actor never picks a disallowed value when the masks reach it: every episode then lasts 16 steps.
// The hello's spaces are declared in configs/masked_choice_external.yaml (this task is not a
// gymnasium env there). Options, handovers and the final JSON line as ../node-cartpole/cartpole.js;
// the session code the examples share is ../node-common/envsession.js.
'use strict';

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { DTYPE_FLOAT32, decodeMultiDiscrete, rng, runSimulator } = require('../node-common/envsession');

const NVEC = [4, 3];
const WIDTH = NVEC[0] + NVEC[1]; // observation size and mask columns
const OFFSETS = [0, NVEC[0]];
const LENGTH = 16;

// N copies stepped in lockstep; each holds its targets, its mask and its step count.
class MaskedChoiceVec {
  constructor(numEnvs, seed) {
    this.n = numEnvs;
    this.random = rng(seed);
    this.target = new Int32Array(numEnvs * NVEC.length);
    this.mask = new Uint8Array(numEnvs * WIDTH); // bool tensor bytes: 0 or 1
    this.elapsed = new Int32Array(numEnvs);
    for (let i = 0; i < numEnvs; i++) this.reset(i);
  }

  draw(i) {
    for (let c = 0; c < NVEC.length; c++) this.target[i * NVEC.length + c] = Math.floor(this.random() * NVEC[c]);
    for (let k = 0; k < WIDTH; k++) this.mask[i * WIDTH + k] = this.random() < 0.5 ? 1 : 0;
    for (let c = 0; c < NVEC.length; c++) this.mask[i * WIDTH + OFFSETS[c] + this.target[i * NVEC.length + c]] = 1;
  }

  reset(i) {
    this.elapsed[i] = 0;
    this.draw(i);
  }

  observe(i, out, row) {
    for (let k = 0; k < WIDTH; k++) out[row * WIDTH + k] = 0;
    for (let c = 0; c < NVEC.length; c++) out[row * WIDTH + OFFSETS[c] + this.target[i * NVEC.length + c]] = 1;
  }

  // One step of env i with action (an Int32Array of one value per choice): [reward, terminated, truncated].
  stepOne(i, action) {
    let allowed = true;
    let reward = 0;
    for (let c = 0; c < NVEC.length; c++) {
      if (!this.mask[i * WIDTH + OFFSETS[c] + action[c]]) allowed = false;
      if (action[c] === this.target[i * NVEC.length + c]) reward += 0.5;
    }
    this.draw(i); // the next observation (the final one when the episode ends here)
    if (!allowed) return [-5.0, true, false];
    this.elapsed[i] += 1;
    return [reward, false, this.elapsed[i] >= LENGTH];
  }

  observations() {
    const obs = new Float32Array(this.n * WIDTH);
    for (let i = 0; i < this.n; i++) this.observe(i, obs, i);
    return obs;
  }

  // The actions allowed at observations(): [N, 7] as bool bytes.
  masks() {
    return this.mask.slice();
  }
}

function decodeActions(t, numEnvs) {
  return decodeMultiDiscrete(t, numEnvs, NVEC);
}

if (require.main === module) {
  runSimulator({ grpc, protoLoader }, {
    name: 'node-masked-choice',
    script: 'masked_choice.js',
    observationSpace: { box: { shape: [WIDTH], dtype: DTYPE_FLOAT32 } },
    actionSpace: { multi_discrete: { nvec: NVEC } },
    obsDim: WIDTH,
    maskWidth: WIDTH,
    make: (numEnvs, seed) => new MaskedChoiceVec(numEnvs, seed),
    decodeActions,
  });
} else {
  module.exports = { MaskedChoiceVec, decodeActions };
}
