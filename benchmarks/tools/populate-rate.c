/*
 * How fast this machine hands out page-cache memory for a new file, fresh
 * and reused. Tidepool's WAL allocator maps each new segment and populates
 * it (MADV_POPULATE_READ) before writers copy values into it; this measures
 * that step alone, in two rounds of six 1 GiB files:
 *
 *   kept:     every file stays (as a store's segments do), so each one
 *             takes memory the page cache has not used before;
 *   replaced: each file is deleted before the next is created, so the next
 *             one reuses the page cache just freed.
 *
 *   cc -O2 -o /tmp/populate-rate benchmarks/tools/populate-rate.c
 *   /tmp/populate-rate /path/on/the/data/disk
 *
 * Needs 6 GiB of free disk (sparse files: only metadata is written) and
 * about as much free memory. See benchmarks/RESULTS.md.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

#define FILES 6
#define FILE_BYTES (1UL << 30)

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int round_of(const char *dir, int replace) {
    char path[4096];
    for (int i = 0; i < FILES; i++) {
        snprintf(path, sizeof path, "%s/populate-rate-%d", dir, i);
        int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || ftruncate(fd, FILE_BYTES) != 0) {
            perror(path);
            return 1;
        }
        char *p = mmap(NULL, FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        double start = seconds();
        if (madvise(p, FILE_BYTES, MADV_POPULATE_READ) != 0) {
            perror("madvise(MADV_POPULATE_READ)");
            return 1;
        }
        double took = seconds() - start;
        printf("%-8s file %d: populated at %.2f GB/s\n", replace ? "replaced" : "kept", i,
               FILE_BYTES / took / 1e9);
        munmap(p, FILE_BYTES);
        close(fd);
        if (replace) unlink(path);
    }
    for (int i = 0; i < FILES; i++) {
        snprintf(path, sizeof path, "%s/populate-rate-%d", dir, i);
        unlink(path);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s <directory on the data disk>\n", argv[0]);
        return 2;
    }
    return round_of(argv[1], 0) || round_of(argv[1], 1);
}
