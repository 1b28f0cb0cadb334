/*
 * How fast this machine hands out page-cache memory for a new file, fresh
 * and reused. Tidepool's WAL allocator maps each new segment and populates
 * it (MADV_POPULATE_READ) before writers copy values into it; this measures
 * that step alone, in three rounds of six 1 GiB files:
 *
 *   kept, 1 thread:  every file stays (as a store's segments do), so each
 *                    one takes memory the page cache has not used before;
 *   kept, 2 threads: the same, each file's two halves populated at once
 *                    by two threads (does fresh memory come faster in
 *                    parallel?);
 *   replaced:        each file is deleted before the next is created, so
 *                    the next one reuses the page cache just freed.
 *
 *   cc -O2 -pthread -o /tmp/populate-rate benchmarks/tools/populate-rate.c
 *   /tmp/populate-rate /path/on/the/data/disk
 *
 * Needs 12 GiB of free disk (sparse files: only metadata is written) and
 * about as much free memory. See benchmarks/RESULTS.md.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
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
#define MAX_THREADS 2

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

struct part {
    char *base;
    size_t len;
    int failed;
};

static void *populate_part(void *arg) {
    struct part *part = arg;
    part->failed = madvise(part->base, part->len, MADV_POPULATE_READ) != 0;
    return NULL;
}

/* Populates [p, p + FILE_BYTES) with `threads` threads, one part each. */
static int populate(char *p, int threads) {
    pthread_t ids[MAX_THREADS];
    struct part parts[MAX_THREADS];
    size_t len = FILE_BYTES / threads;
    for (int t = 0; t < threads; t++) {
        parts[t] = (struct part){p + t * len, len, 0};
        if (pthread_create(&ids[t], NULL, populate_part, &parts[t]) != 0) return 1;
    }
    int failed = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(ids[t], NULL);
        failed |= parts[t].failed;
    }
    if (failed) perror("madvise(MADV_POPULATE_READ)");
    return failed;
}

/* One round of FILES files named <dir>/populate-rate-<name>-<i>, each
 * populated by `threads` threads; `replace` deletes each file before the
 * next. Kept files stay until `cleanup`. */
static int round_of(const char *dir, const char *name, int replace, int threads) {
    char path[4096];
    for (int i = 0; i < FILES; i++) {
        snprintf(path, sizeof path, "%s/populate-rate-%s-%d", dir, name, i);
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
        if (populate(p, threads) != 0) return 1;
        double took = seconds() - start;
        printf("%-8s file %d, %d thread(s): populated at %.2f GB/s\n",
               replace ? "replaced" : "kept", i, threads, FILE_BYTES / took / 1e9);
        munmap(p, FILE_BYTES);
        close(fd);
        if (replace) unlink(path);
    }
    return 0;
}

static void cleanup(const char *dir, const char *name) {
    char path[4096];
    for (int i = 0; i < FILES; i++) {
        snprintf(path, sizeof path, "%s/populate-rate-%s-%d", dir, name, i);
        unlink(path);
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s <directory on the data disk>\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    /* Fresh memory by one thread, then by two (the kept files of the first
     * round stay, so the second cannot reuse their memory), then reused. */
    int failed = round_of(dir, "kept1", 0, 1) || round_of(dir, "kept2", 0, 2);
    cleanup(dir, "kept1");
    cleanup(dir, "kept2");
    return failed || round_of(dir, "replaced", 1, 1);
}
