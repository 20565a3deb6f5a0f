// The chat page served at GET /: one self-contained HTML file (src/server/web/chat.html, no
// external scripts, styles or fonts) compiled into the binary.
#pragma once

namespace dsv3::server {

const char* chat_page_html();

}  // namespace dsv3::server
