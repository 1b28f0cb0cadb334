#include <stdio.h>
int main(void) { puts("hello from a cached binary"); return 0; }
