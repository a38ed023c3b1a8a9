# embed.cmake: cmake -DIN=file -DOUT=file.c -DNAME=sym -P embed.cmake
# Writes `const unsigned char NAME[]` and `const unsigned long NAME_len`.
file(READ ${IN} hex HEX)
string(LENGTH "${hex}" n)
math(EXPR len "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
file(WRITE ${OUT} "/* generated from ${IN} */\nconst unsigned char ${NAME}[] = {${body}};\nconst unsigned long ${NAME}_len = ${len};\n")
