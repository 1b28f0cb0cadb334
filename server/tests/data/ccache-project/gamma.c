/* A small translation unit for the ccache remote-storage test. */
#include <stdio.h>
#include <string.h>

int gamma_checksum(const char *text) {
    int sum = 0;
    for (size_t i = 0; i < strlen(text); i++) {
        sum = sum * 31 + (unsigned char)text[i];
    }
    printf("%s: %d\n", "gamma", sum);
    return sum;
}
