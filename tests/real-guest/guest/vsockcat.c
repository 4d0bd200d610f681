/*
 * vsockcat: the real-guest scenarios' AF_VSOCK tool, run inside L2 guests
 * (built static by the harness; busybox has no vsock support).
 *
 *   vsockcat connect PORT   connect to the host (CID 2) on PORT
 *   vsockcat listen PORT    accept one connection on PORT
 *   vsockcat echo PORT      accept connections on PORT forever, one at a
 *                           time, and send every byte back
 *
 * connect and listen copy stdin to the socket and the socket to stdout until
 * the peer ends; at the end of stdin they shut the socket's write side, so
 * the peer reads end-of-file. Exit status 0 on a clean end, 1 on an error
 * (printed to stderr), 2 on bad usage.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <linux/vm_sockets.h>

static int fail(const char *what)
{
	fprintf(stderr, "vsockcat: %s: %s\n", what, strerror(errno));
	return 1;
}

/* Writes all of buf; 0 or -1. */
static int write_all(int fd, const char *buf, ssize_t len)
{
	while (len > 0) {
		ssize_t n = write(fd, buf, len);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		buf += n;
		len -= n;
	}
	return 0;
}

/* Sends back everything read from c until the peer ends. */
static void echo(int c)
{
	static char buf[65536];
	ssize_t n;
	while ((n = read(c, buf, sizeof buf)) > 0)
		if (write_all(c, buf, n))
			break;
	close(c);
}

static int pump(int s)
{
	static char buf[65536];
	int in_open = 1, sock_open = 1;
	while (sock_open) {
		struct pollfd p[2] = {
			{ .fd = s, .events = POLLIN },
			{ .fd = in_open ? 0 : -1, .events = POLLIN },
		};
		if (poll(p, 2, -1) < 0) {
			if (errno == EINTR)
				continue;
			return fail("poll");
		}
		if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
			ssize_t n = read(s, buf, sizeof buf);
			if (n < 0)
				return fail("read from socket");
			if (n == 0)
				sock_open = 0;
			else if (write_all(1, buf, n))
				return fail("write to stdout");
		}
		if (in_open && (p[1].revents & (POLLIN | POLLHUP | POLLERR))) {
			ssize_t n = read(0, buf, sizeof buf);
			if (n < 0)
				return fail("read from stdin");
			if (n == 0) {
				in_open = 0;
				if (shutdown(s, SHUT_WR))
					return fail("shutdown");
			} else if (write_all(s, buf, n)) {
				return fail("write to socket");
			}
		}
	}
	return 0;
}

int main(int argc, char **argv)
{
	struct sockaddr_vm a;
	int s, c;
	if (argc != 3 || (strcmp(argv[1], "connect") && strcmp(argv[1], "listen") &&
			  strcmp(argv[1], "echo"))) {
		fprintf(stderr, "usage: vsockcat connect|listen|echo PORT\n");
		return 2;
	}
	memset(&a, 0, sizeof a);
	a.svm_family = AF_VSOCK;
	a.svm_port = (unsigned)atoi(argv[2]);
	s = socket(AF_VSOCK, SOCK_STREAM, 0);
	if (s < 0)
		return fail("socket");
	if (!strcmp(argv[1], "connect")) {
		a.svm_cid = VMADDR_CID_HOST;
		if (connect(s, (struct sockaddr *)&a, sizeof a))
			return fail("connect");
		return pump(s);
	}
	a.svm_cid = VMADDR_CID_ANY;
	if (bind(s, (struct sockaddr *)&a, sizeof a) || listen(s, 4))
		return fail("bind/listen");
	if (!strcmp(argv[1], "echo")) {
		for (;;) {
			c = accept(s, NULL, NULL);
			if (c < 0 && errno != EINTR)
				return fail("accept");
			if (c >= 0)
				echo(c);
		}
	}
	c = accept(s, NULL, NULL);
	if (c < 0)
		return fail("accept");
	close(s);
	return pump(c);
}
