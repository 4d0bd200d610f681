/*
 * fsbench: the share group's measurements, run inside a real guest (static,
 * no libraries), timed with the guest's CLOCK_MONOTONIC (kvm-clock):
 *
 *   fsbench read FILE    reads FILE to its end in 1 MiB reads;
 *                        prints "bytes=N ns=T"
 *   fsbench meta DIR N   creates N empty files f0..f<N-1> in DIR (open with
 *                        O_CREAT|O_EXCL, close), stats each, unlinks each;
 *                        prints "n=N create_ns=T stat_ns=T unlink_ns=T"
 *
 * Any failure prints "error: ..." on stderr and exits 1.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static long long now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int fail(const char *what, const char *path)
{
	fprintf(stderr, "error: %s %s: %s\n", what, path, strerror(errno));
	return 1;
}

static int bench_read(const char *path)
{
	static char buf[1 << 20];
	long long bytes = 0, t0 = now_ns();
	int fd = open(path, O_RDONLY);
	if (fd < 0)
		return fail("open", path);
	for (;;) {
		ssize_t n = read(fd, buf, sizeof buf);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return fail("read", path);
		}
		if (n == 0)
			break;
		bytes += n;
	}
	close(fd);
	printf("bytes=%lld ns=%lld\n", bytes, now_ns() - t0);
	return 0;
}

static int bench_meta(const char *dir, int n)
{
	char path[4096];
	struct stat st;
	long long t[4];
	int i;

	t[0] = now_ns();
	for (i = 0; i < n; i++) {
		snprintf(path, sizeof path, "%s/f%d", dir, i);
		int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0644);
		if (fd < 0)
			return fail("create", path);
		close(fd);
	}
	t[1] = now_ns();
	for (i = 0; i < n; i++) {
		snprintf(path, sizeof path, "%s/f%d", dir, i);
		if (stat(path, &st) != 0)
			return fail("stat", path);
	}
	t[2] = now_ns();
	for (i = 0; i < n; i++) {
		snprintf(path, sizeof path, "%s/f%d", dir, i);
		if (unlink(path) != 0)
			return fail("unlink", path);
	}
	t[3] = now_ns();
	printf("n=%d create_ns=%lld stat_ns=%lld unlink_ns=%lld\n", n, t[1] - t[0], t[2] - t[1],
	       t[3] - t[2]);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 3 && strcmp(argv[1], "read") == 0)
		return bench_read(argv[2]);
	if (argc == 4 && strcmp(argv[1], "meta") == 0) {
		int n = atoi(argv[3]);
		if (n <= 0) {
			fprintf(stderr, "error: N must be a positive number, not %s\n", argv[3]);
			return 1;
		}
		return bench_meta(argv[2], n);
	}
	fprintf(stderr, "usage: fsbench read FILE | fsbench meta DIR N\n");
	return 1;
}
