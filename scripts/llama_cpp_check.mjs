// llama.cpp's next-token distributions on a GGUF file, through node-llama-cpp's prebuilt CPU binary (issue 53).
//
//   node scripts/llama_cpp_check.mjs ENGINE_DIR MODEL.gguf WINDOWS.json OUT.f32
//
// ENGINE_DIR holds node_modules/node-llama-cpp (scripts/install_llama_engine.sh). WINDOWS.json is a list of token
// id lists; every window is evaluated alone, from an empty cache, as given (no BOS added, no tokenizer). For each
// window and each position but the last, OUT.f32 receives llama.cpp's probabilities of every vocabulary entry
// being the next token, float32 in the machine's byte order, windows one after another, token ids in order.
// They are the softmax of the raw logits: with the greedy sampler (no temperature, top-k, top-p or penalties)
// node-llama-cpp's sampleToken normalises the logits of the whole vocabulary (llama/addon/AddonContext.cpp).
// Standard output gets one JSON line: the vocabulary size, the positions per window and the engine's version;
// a failure ends with one `error: …` line on stderr and exit 1. benchmarks/llama_node.py drives it.

import fs from "node:fs";
import path from "node:path";
import {pathToFileURL} from "node:url";

async function main([engineDir, modelPath, windowsPath, outPath]) {
    const packageDir = path.join(engineDir, "node_modules", "node-llama-cpp");
    const {getLlama} = await import(pathToFileURL(path.join(packageDir, "dist", "index.js")).href);
    const version = JSON.parse(fs.readFileSync(path.join(packageDir, "package.json"), "utf8")).version;
    const windows = JSON.parse(fs.readFileSync(windowsPath, "utf8"));
    const longest = Math.max(...windows.map((w) => w.length));

    // build "never": the prebuilt binary or an error, never a download or a compile; CPU only, as quantdiff's side
    const llama = await getLlama({gpu: false, build: "never", skipDownload: true, logLevel: "error", progressLogs: false});
    const model = await llama.loadModel({modelPath, gpuLayers: 0});
    const context = await model.createContext({contextSize: longest, batchSize: longest, threads: 2, sequences: 1});
    const sequence = context.getSequence();

    const out = fs.openSync(outPath, "w");
    let vocab = null;
    for (const window of windows) {
        await sequence.clearHistory();
        const input = window.slice(0, -1).map((token) => [token, {generateNext: {probabilities: true}}]);
        for (const result of await sequence.controlledEvaluate(input)) {
            const probabilities = result.next.probabilities; // sorted by probability: placed back by token id
            vocab ??= probabilities.size;
            if (probabilities.size !== vocab)
                throw new Error(`a position gave ${probabilities.size} probabilities, the first ${vocab}`);
            const row = new Float32Array(vocab);
            for (const [token, probability] of probabilities)
                row[token] = probability;
            fs.writeSync(out, row);
        }
    }
    fs.closeSync(out);
    const release = llama.llamaCppRelease.release;
    console.log(JSON.stringify({
        vocab,
        positions: windows.map((w) => w.length - 1),
        engine: `node-llama-cpp ${version} (llama.cpp ${release}, ${llama.buildType} CPU binary), threads 2`,
        system: llama.systemInfo
    }));
    await llama.dispose();
}

const args = process.argv.slice(2);
if (args.length !== 4) {
    console.error("error: usage: node llama_cpp_check.mjs ENGINE_DIR MODEL.gguf WINDOWS.json OUT.f32");
    process.exit(2);
}
main(args).catch((error) => {
    console.error(`error: ${String(error?.message ?? error).split("\n")[0]}`);
    process.exit(1);
});
