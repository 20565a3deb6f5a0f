# cmake -DIN=file -DOUT=header -DNAME=identifier -P embed_text.cmake: writes a header holding the
# file's text as `inline constexpr char NAME[]` (a raw string literal).
file(READ "${IN}" text)
set(delim "dsv3embed")
string(FIND "${text}" ")${delim}\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${IN} contains the raw string delimiter )${delim}\" and cannot be embedded")
endif()
file(WRITE "${OUT}.tmp" "// Generated from ${IN} by cmake/embed_text.cmake: do not edit.\n#pragma once\n"
                        "inline constexpr char ${NAME}[] = R\"${delim}(${text})${delim}\";\n")
file(RENAME "${OUT}.tmp" "${OUT}")
