// disk_probe: direct reads in the pattern of Picchio's expert readers, outside Picchio, to
// tell the disk's own speed from the engine's. READERS threads pull 2 MiB pieces of
// pseudo-random whole records (RECORD_STRIDE bytes apart, as in the container's manifest:
// experts.record_stride) from one shared counter with O_DIRECT, into buffers that are either
// 2 MiB-aligned and advised MADV_HUGEPAGE ("huge": one per reader, reused by every read) or
// 4 KiB-aligned ("small"), or ("pool") 2 MiB slots of one 1.5 GiB region (DISK_PROBE_POOL_MIB
// sets another size) advised
// MADV_HUGEPAGE and touched first, each read into the next slot in turn, as the cache's record
// buffers are filled (a different region of memory for every read), or ("stage") each read
// into the reader's own reused huge-page buffer and then copied into the next slot. Prints GB/s per GiB read and overall. With COPIERS > 0, that many more threads
// copy 256 MiB buffers back and forth while the readers run (memory traffic like the expert
// kernels' while the engine's reads are in flight) and print the rate they copied. Linux
// only; not built by CI.
//
//   gcc -O2 -pthread benches/regime/disk_probe.c -o /tmp/disk_probe
//   /tmp/disk_probe CONTAINER/experts.bin GIB READERS RECORD_STRIDE huge|small|pool|stage [SEED [COPIERS]]
//
// docs/perf.md ("Zen 4 VM, 2026-12-06 morning") has what it measured.
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define PIECE (2L << 20)
#define MAX_READERS 64

static int fd, huge;
static char *pool;  // "pool" and "stage" modes: pool_bytes of 2 MiB slots, filled in turn
static long pool_bytes = 1536L << 20;  // DISK_PROBE_POOL_MIB overrides
static int stage;   // "stage": read into the reader's own buffer, then copy into the slot
static long stride, per_record, pieces;
static long *record_of;
static atomic_long next_piece;
static double *done_at, start;
static long *done_bytes;
static atomic_int reading;  // readers still running: the copiers stop when it reaches 0

#define COPY_BYTES (256L << 20)

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *reader(void *unused) {
  (void)unused;
  void *buf;
  if (posix_memalign(&buf, huge ? PIECE : 4096, PIECE) != 0) { perror("posix_memalign"); exit(1); }
  if (huge) madvise(buf, PIECE, MADV_HUGEPAGE);
  memset(buf, 1, PIECE);  // touched before timing, as the cache prepares its buffers
  for (;;) {
    long i = atomic_fetch_add(&next_piece, 1);
    if (i >= pieces) {
      atomic_fetch_sub(&reading, 1);
      free(buf);
      return NULL;
    }
    long p = i % per_record, offset = record_of[i / per_record] * stride + p * PIECE;
    long n = stride - p * PIECE;
    if (n > PIECE) n = PIECE;
    n = (n + 4095) / 4096 * 4096;
    char *slot = pool ? pool + (i % (pool_bytes / PIECE)) * PIECE : buf;
    ssize_t got = pread(fd, stage ? buf : slot, n, offset);
    if (stage && got > 0) memcpy(slot, buf, got);
    if (got < 0) { perror("pread"); exit(1); }
    done_at[i] = now() - start;
    done_bytes[i] = got;
  }
}

// Copies two buffers into each other until the readers are done; returns bytes copied.
static void *copier(void *unused) {
  (void)unused;
  char *a = malloc(COPY_BYTES), *b = malloc(COPY_BYTES);
  if (!a || !b) { perror("malloc"); exit(1); }
  memset(a, 1, COPY_BYTES);
  memset(b, 2, COPY_BYTES);
  long copies = 0;
  while (atomic_load(&reading) > 0) {
    memcpy(copies % 2 ? a : b, copies % 2 ? b : a, COPY_BYTES);
    copies++;
  }
  free(a);
  free(b);
  return (void *)copies;
}

int main(int argc, char **argv) {
  if (argc < 6 || (strcmp(argv[5], "huge") && strcmp(argv[5], "small") && strcmp(argv[5], "pool") &&
                  strcmp(argv[5], "stage"))) {
    fprintf(stderr, "usage: %s FILE GIB READERS RECORD_STRIDE huge|small|pool|stage [SEED [COPIERS]]\n", argv[0]);
    return 2;
  }
  double gib = atof(argv[2]);
  int readers = atoi(argv[3]);
  stride = atol(argv[4]);
  huge = strcmp(argv[5], "small") != 0;
  stage = !strcmp(argv[5], "stage");
  if (!strcmp(argv[5], "pool") || stage) {
    const char *mib = getenv("DISK_PROBE_POOL_MIB");
    if (mib && atol(mib) >= 2) pool_bytes = atol(mib) / 2 * 2 * (1L << 20);
    if (posix_memalign((void **)&pool, PIECE, pool_bytes) != 0) { perror("posix_memalign"); return 1; }
    madvise(pool, pool_bytes, MADV_HUGEPAGE);
    memset(pool, 1, pool_bytes);
  }
  if (gib <= 0 || readers < 1 || readers > MAX_READERS || stride < 4096 || stride % 4096) {
    fprintf(stderr, "GIB > 0, 1 <= READERS <= %d, RECORD_STRIDE a positive multiple of 4096\n", MAX_READERS);
    return 2;
  }
  fd = open(argv[1], O_RDONLY | O_DIRECT);
  if (fd < 0) { perror(argv[1]); return 1; }
  struct stat st;
  fstat(fd, &st);
  long records = st.st_size / stride;
  if (records < 1) { fprintf(stderr, "%s holds no whole record of %ld bytes\n", argv[1], stride); return 1; }
  per_record = (stride + PIECE - 1) / PIECE;
  long wanted = (long)(gib * (1L << 30) / stride) + 1;
  pieces = wanted * per_record;
  record_of = malloc(wanted * sizeof(long));
  done_at = calloc(pieces, sizeof(double));
  done_bytes = calloc(pieces, sizeof(long));
  srand(argc > 6 ? atoi(argv[6]) : time(NULL));
  for (long i = 0; i < wanted; i++) record_of[i] = ((long)rand() * 7919 + rand()) % records;
  int copiers = argc > 7 ? atoi(argv[7]) : 0;
  if (copiers < 0 || copiers > MAX_READERS) {
    fprintf(stderr, "0 <= COPIERS <= %d\n", MAX_READERS);
    return 2;
  }
  pthread_t threads[MAX_READERS], copy_threads[MAX_READERS];
  atomic_store(&reading, readers);
  for (int i = 0; i < copiers; i++) pthread_create(&copy_threads[i], NULL, copier, NULL);
  start = now();
  for (int i = 0; i < readers; i++) pthread_create(&threads[i], NULL, reader, NULL);
  for (int i = 0; i < readers; i++) pthread_join(threads[i], NULL);
  double copied = 0;
  for (int i = 0; i < copiers; i++) {
    void *n;
    pthread_join(copy_threads[i], &n);
    copied += (double)(long)n * COPY_BYTES;
  }
  // 1 GiB windows, pieces taken in issue order.
  double last = 0, window = 0, latest = 0, total = 0;
  printf("GB/s per GiB:");
  for (long i = 0; i < pieces; i++) {
    window += done_bytes[i];
    total += done_bytes[i];
    if (done_at[i] > latest) latest = done_at[i];
    if (window >= (1L << 30)) {
      printf(" %.2f", window / (latest - last) / 1e9);
      window = 0;
      last = latest;
    }
  }
  printf("  overall %.2f GB/s over %.1f s", total / latest / 1e9, latest);
  // The copiers' rate includes their start (filling their buffers) before the clock.
  if (copiers > 0) printf("; %d copiers moved about %.1f GB/s", copiers, copied / latest / 1e9);
  printf("\n");
  return 0;
}
