// The official `openai` npm client, unmodified, against `dsv3 serve` on the tiny model: chat,
// streamed chat (with usage), completions streamed and not, logprobs, reasoning_content through
// chat_template_kwargs, an aborted stream, and errors as the client's own error classes.
"use strict";
const assert = require("node:assert/strict");
const { requireDep, makeWorkspace, startServer, run } = require("./helpers.cjs");

const OpenAI = requireDep("openai");

run("openai client", async () => {
  const ws = makeWorkspace();
  const server = await startServer(ws.model, ["--served-model-name", "tiny", "--api-key", "test-key",
                                              "--tokenizer", ws.thinkingTokenizer]);
  try {
    const client = new OpenAI({ baseURL: server.url + "/v1", apiKey: "test-key", maxRetries: 0, timeout: 120000 });
    const messages = [{ role: "user", content: "Write a haiku about the sea." }];

    const models = await client.models.list();
    assert.deepEqual(models.data.map((m) => m.id), ["tiny"]);

    const chat = await client.chat.completions.create({ model: "tiny", messages, max_tokens: 12, temperature: 0 });
    assert.equal(chat.object, "chat.completion");
    assert.equal(chat.choices[0].message.role, "assistant");
    assert.equal(typeof chat.choices[0].message.content, "string");
    assert.equal(chat.choices[0].finish_reason, "length");
    assert.equal(chat.usage.completion_tokens, 12);

    const stream = await client.chat.completions.create({
      model: "tiny", messages, max_tokens: 12, temperature: 0, stream: true, stream_options: { include_usage: true },
    });
    let text = "", finish = null, usage = null;
    for await (const chunk of stream) {
      for (const c of chunk.choices) {
        text += c.delta.content || "";
        if (c.finish_reason) finish = c.finish_reason;
      }
      if (chunk.usage) usage = chunk.usage;
    }
    assert.equal(text, chat.choices[0].message.content);
    assert.equal(finish, "length");
    assert.deepEqual(usage, chat.usage);

    const comp = await client.completions.create({ model: "tiny", prompt: "The sea is", max_tokens: 6, temperature: 0,
                                                   logprobs: 2 });
    assert.equal(comp.object, "text_completion");
    assert.equal(comp.choices[0].logprobs.tokens.length, 6);
    let streamed = "";
    for await (const chunk of await client.completions.create({ model: "tiny", prompt: "The sea is", max_tokens: 6,
                                                                temperature: 0, stream: true })) {
      streamed += chunk.choices.map((c) => c.text).join("");
    }
    assert.equal(streamed, comp.choices[0].text);

    const lp = await client.chat.completions.create({ model: "tiny", messages, max_tokens: 3, temperature: 0,
                                                      logprobs: true, top_logprobs: 2 });
    assert.equal(lp.choices[0].logprobs.content.length, 3);
    assert.equal(lp.choices[0].logprobs.content[0].top_logprobs.length, 2);

    // A thinking prompt: the answer so far is reasoning (the random model never closes <think>).
    const think = await client.chat.completions.create({ model: "tiny", messages, max_tokens: 8, temperature: 0,
                                                         chat_template_kwargs: { thinking: true } });
    assert.ok(think.choices[0].message.reasoning_content.length > 0);
    assert.equal(think.choices[0].message.content, "");

    // Aborting a stream cancels its request on the server.
    const long = await client.chat.completions.create({ model: "tiny", messages, max_tokens: 5000, stream: true,
                                                        ignore_eos: true });
    let got = 0;
    for await (const chunk of long) {
      if (++got === 5) long.controller.abort();
    }
    let metrics = "";
    for (let i = 0; i < 100; i++) {
      metrics = await (await fetch(server.url + "/metrics")).text();
      if (/kind="client_disconnect"\} 1\n/.test(metrics) && /dsv3:num_requests_running\{[^}]*\} 0\n/.test(metrics)) break;
      await new Promise((r) => setTimeout(r, 100));
    }
    assert.match(metrics, /kind="client_disconnect"\} 1\n/);
    assert.match(metrics, /dsv3:kv_blocks_used\{[^}]*\} 0\n/);

    await assert.rejects(client.chat.completions.create({ model: "nope", messages }), (e) => {
      assert.ok(e instanceof OpenAI.NotFoundError, e.constructor.name);
      assert.equal(e.status, 404);
      assert.equal(e.code, "model_not_found");
      return true;
    });
    await assert.rejects(client.chat.completions.create({ model: "tiny", messages, temperature: "warm" }), (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError, e.constructor.name);
      assert.equal(e.param, "temperature");
      return true;
    });
    const stranger = new OpenAI({ baseURL: server.url + "/v1", apiKey: "wrong", maxRetries: 0 });
    await assert.rejects(stranger.models.list(), (e) => e instanceof OpenAI.AuthenticationError);
  } finally {
    const code = await server.stop();
    ws.remove();
    assert.equal(code, 0, "dsv3 serve exits 0 on SIGTERM");
  }
});
