// Score a token sequence with llama.cpp itself: per-token negative log-likelihood and greedy (top-1) token.
//
// Used by bench/llama_cpp_scoring.py, which installs node-llama-cpp (prebuilt llama.cpp binaries from npm,
// no C++ build) into a cache folder and passes it as NODE_LLAMA_CPP_DIR.
//
//   NODE_LLAMA_CPP_DIR=~/.cache/hf_posext/node-llama-cpp node bench/llama_cpp_score.mjs MODEL.gguf TOKENS.json OUT.json
//
// TOKENS.json: {"tokens": [int, ...], "threads": int, "kv_cache": "F16" (llama.cpp's default) or "F32"}. OUT.json: {"nll": [...], "top1": [...], "llama_cpp": {...}},
// one entry per predicted token (tokens[1:]): nll[i] = -log p(tokens[i + 1] | tokens[..i]) from llama.cpp's
// raw logits (log-sum-exp over the whole vocabulary), top1[i] = llama.cpp's highest-logit token there.
import {readFileSync, writeFileSync} from "node:fs";
import {join} from "node:path";
import {pathToFileURL} from "node:url";

const [modelPath, tokensPath, outPath] = process.argv.slice(2);
if (!modelPath || !tokensPath || !outPath) {
    console.error("usage: node llama_cpp_score.mjs MODEL.gguf TOKENS.json OUT.json");
    process.exit(2);
}
const home = process.env.NODE_LLAMA_CPP_DIR;
if (!home) {
    console.error("NODE_LLAMA_CPP_DIR is not set: run bench/llama_cpp_scoring.py, which installs node-llama-cpp");
    process.exit(2);
}
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(join(home, "node_modules", "node-llama-cpp", "dist", "index.js")).href);
const {tokens, threads, kv_cache: kvCache = "F16"} = JSON.parse(readFileSync(tokensPath, "utf8"));

const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({contextSize: tokens.length, batchSize: tokens.length, sequences: 1,
                                           threads: threads ?? 1, flashAttention: false,
                                           experimentalKvCacheKeyType: kvCache, experimentalKvCacheValueType: kvCache});
const sequence = context.getSequence();
const last = tokens.length - 1;
const input = tokens.map((token, i) => i === last ? token : [token, {generateNext: {
    logits: {filter: {tokens: [tokens[i + 1]], includeTop: 1}}, totalLogitWeight: true}}]);
const outputs = await sequence.controlledEvaluate(input);
const nll = [];
const top1 = [];
for (let i = 0; i < last; i++) {
    const next = outputs[i].next;
    let [maxToken, maxLogit] = [null, -Infinity];  // the target and the top token (includeMax returned the target alone in 3.22.1)
    for (const [token, logit] of next.logits) {
        if (logit > maxLogit) [maxToken, maxLogit] = [token, logit];
    }
    const target = next.logits.get(tokens[i + 1]);
    // log p(target) = target - max - log(sum exp(logit - max))
    nll.push(Math.log(next.totalLogitWeight) + maxLogit - target);
    top1.push(maxToken);
}
writeFileSync(outPath, JSON.stringify({nll, top1, llama_cpp: {
    build: llama.buildType, gpu: llama.gpu, context_size: context.contextSize, threads: context.currentThreads, kv_cache: kvCache}}));
await context.dispose();
await model.dispose();
await llama.dispose();
