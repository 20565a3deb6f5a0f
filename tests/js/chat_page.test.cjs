// The chat page at GET / in headless Chromium (Debian's, driven by playwright-core): the model's
// name shows, a typed message gets a streamed answer, the thinking switch shows reasoning apart
// from the answer, and the page loads nothing from anywhere but the server. A screenshot goes to
// $DSV3_SCREENSHOT when set.
"use strict";
const assert = require("node:assert/strict");
const fs = require("node:fs");
const { requireDep, makeWorkspace, startServer, run } = require("./helpers.cjs");

const { chromium } = requireDep("playwright-core");
const chromiumPath = process.env.DSV3_CHROMIUM || "/usr/bin/chromium";

run("chat page", async () => {
  if (!fs.existsSync(chromiumPath))
    throw new Error(`no Chromium at ${chromiumPath}: run scripts/setup.sh (Debian package chromium) or set DSV3_CHROMIUM`);
  const ws = makeWorkspace();
  const server = await startServer(ws.model, ["--served-model-name", "tiny-random", "--tokenizer", ws.thinkingTokenizer]);
  const browser = await chromium.launch({ executablePath: chromiumPath, args: ["--no-sandbox"] });
  try {
    const page = await browser.newPage({ viewport: { width: 960, height: 640 } });
    const foreign = [];
    page.on("request", (r) => { if (!r.url().startsWith(server.url)) foreign.push(r.url()); });
    const chunks = [];
    page.on("response", (r) => { if (r.url().endsWith("/v1/chat/completions")) chunks.push(r.headers()["content-type"]); });
    await page.goto(server.url + "/");
    await page.waitForFunction(() => document.getElementById("model").textContent.startsWith("tiny-random"));

    await page.fill("#max_tokens", "24");
    await page.fill("#temperature", "0");
    await page.fill("#prompt", "Hello! What can you do?");
    await page.press("#prompt", "Enter");
    // The answer streams in; the page is done when Send is enabled again and the stats show.
    await page.waitForSelector(".msg.assistant .stats", { timeout: 60000 });
    const answer = await page.textContent(".msg.assistant .content");
    assert.ok(answer.length > 0, "an answer");
    assert.equal(await page.isHidden(".msg.assistant details.thinking"), true);
    assert.match(await page.textContent(".msg.assistant .stats"), /24 tokens in/);
    assert.equal(await page.locator(".msg.assistant .error").count(), 0);
    assert.equal(chunks[0], "text/event-stream");

    // The same question over the API gives the same text the page showed.
    const api = await (await fetch(server.url + "/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ messages: [{ role: "user", content: "Hello! What can you do?" }], max_tokens: 24, temperature: 0 }),
    })).json();
    assert.equal(answer, api.choices[0].message.content);

    // Thinking on: the second answer has a visible reasoning box.
    await page.check("#thinking");
    await page.fill("#prompt", "And why is the sky blue?");
    await page.click("#send");
    await page.waitForFunction(() => document.querySelectorAll(".msg.assistant .stats").length === 2, null, { timeout: 60000 });
    const second = page.locator(".msg.assistant").nth(1);
    assert.equal(await second.locator("details.thinking").isVisible(), true);
    assert.ok((await second.locator(".reasoning").textContent()).length > 0, "reasoning shown");
    assert.equal(foreign.length, 0, "requests outside the server: " + foreign.join(", "));
    if (process.env.DSV3_SCREENSHOT) {
      await second.locator("details.thinking summary").click();  // show the reasoning
      await page.screenshot({ path: process.env.DSV3_SCREENSHOT });
    }
  } finally {
    await browser.close();
    const code = await server.stop();
    ws.remove();
    assert.equal(code, 0, "dsv3 serve exits 0 on SIGTERM");
  }
});
