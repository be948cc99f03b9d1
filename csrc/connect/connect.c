/* stockade-connect HOST PORT: a TCP connection through the sandbox's proxy, on stdin/stdout.
 *
 * Copied into a --net allow sandbox as /run/stockade/connect: ssh's ProxyCommand and
 * git's GIT_PROXY_COMMAND run it to reach HOST:PORT, since the sandbox's network
 * namespace has no route out. It speaks SOCKS5 (no authentication, CONNECT, the name
 * sent as is so the proxy resolves it and checks the allowlist) to 127.0.0.1:3128, where
 * the proxy's listening socket lives, then relays stdin -> socket and socket -> stdout
 * until both directions have ended (EOF on stdin becomes shutdown(SHUT_WR), EOF from the
 * socket closes stdout).
 *
 * Exit status: 0 when the relay ended normally, 1 when the proxy cannot be reached,
 * refuses the connection (one line on stderr with the reply code's meaning) or the
 * connection fails, 2 for a usage error.
 *
 * STOCKADE_CONNECT_PORT overrides the proxy's port (tests run a SOCKS5 server on a free
 * port of the host's loopback); nothing else is configurable.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#define PROXY_PORT 3128
#define BUF_SIZE (128 * 1024)

static const char *prog = "stockade-connect";
static char target[300]; /* HOST:PORT as messages print it */
static int proxy_port = PROXY_PORT;

static void die(int status, const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s: %s\n", prog, line);
    exit(status);
}

static void usage(const char *what)
{
    die(2, "%s (usage: stockade-connect HOST PORT: HOST a name or an IP address, PORT 1-65535)", what);
}

static long parse_port(const char *s)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (!*s || *end || errno || v < 1 || v > 65535 || s[0] == '+' || s[0] == '-' || s[0] == ' ')
        return -1;
    return v;
}

/* What a SOCKS5 reply code means (RFC 1928 6), as the sandbox's proxy uses them. */
static const char *reply_meaning(unsigned code, const char *host, char *buf, size_t n)
{
    switch (code) {
    case 0x01: return "general proxy failure (or too many open connections in this run)";
    case 0x02:
        snprintf(buf, n, "not allowed by the network policy: stockade allow --host %s", host);
        return buf;
    case 0x03: return "network unreachable";
    case 0x04: return "host unreachable (the name does not resolve, or no address answered)";
    case 0x05: return "connection refused by the destination";
    case 0x06: return "TTL expired";
    case 0x07: return "command not supported by the proxy";
    case 0x08: return "address type not supported by the proxy";
    default:
        snprintf(buf, n, "unknown SOCKS5 reply code 0x%02x", code);
        return buf;
    }
}

static void write_all(int fd, const unsigned char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            die(1, "cannot talk to the sandbox's proxy at 127.0.0.1:%d for %s: %s", proxy_port, target, strerror(errno));
        p += w;
        n -= (size_t)w;
    }
}

/* Exactly n bytes of the proxy's reply, so nothing after the reply is consumed here. */
static void read_exact(int fd, unsigned char *p, size_t n)
{
    while (n) {
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            die(1, "cannot talk to the sandbox's proxy at 127.0.0.1:%d for %s: %s", proxy_port, target, strerror(errno));
        if (r == 0)
            die(1, "the sandbox's proxy at 127.0.0.1:%d closed the connection during the SOCKS5 handshake for %s",
                proxy_port, target);
        p += r;
        n -= (size_t)r;
    }
}

static int socks_connect(const char *host, int port)
{
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        die(1, "socket: %s", strerror(errno));
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)proxy_port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    while (connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        if (errno == EINTR)
            continue;
        die(1, "cannot reach the sandbox's proxy at 127.0.0.1:%d for %s: %s (the proxy runs only inside a sandbox "
               "started with --net allow)", proxy_port, target, strerror(errno));
    }
    int one = 1;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)); /* interactive ssh */

    unsigned char req[4 + 1 + 255 + 2];
    size_t n = 0;
    req[n++] = 5; /* greeting: version 5, one method, "no authentication" */
    req[n++] = 1;
    req[n++] = 0;
    write_all(s, req, n);
    unsigned char rep[4 + 1 + 255 + 2];
    read_exact(s, rep, 2);
    if (rep[0] != 5)
        die(1, "the sandbox's proxy at 127.0.0.1:%d did not answer as a SOCKS5 server (first byte 0x%02x)", proxy_port,
            rep[0]);
    if (rep[1] != 0) /* the sandbox's proxy says 0xff at once when too many connections are mid-handshake */
        die(1, "%s refused by the sandbox's proxy: it accepts no authentication method offered (0x%02x: too many "
               "connections at once in this run, or not stockade's proxy)", target, rep[1]);

    /* request: version, CONNECT, reserved, the address (an IP literal as itself, a name
     * for the proxy to resolve), the port */
    n = 0;
    req[n++] = 5;
    req[n++] = 1;
    req[n++] = 0;
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, host, &a4) == 1) {
        req[n++] = 1;
        memcpy(req + n, &a4, 4);
        n += 4;
    } else if (inet_pton(AF_INET6, host, &a6) == 1) {
        req[n++] = 4;
        memcpy(req + n, &a6, 16);
        n += 16;
    } else {
        size_t len = strlen(host);
        req[n++] = 3;
        req[n++] = (unsigned char)len;
        memcpy(req + n, host, len);
        n += len;
    }
    req[n++] = (unsigned char)(port >> 8);
    req[n++] = (unsigned char)(port & 0xff);
    write_all(s, req, n);

    read_exact(s, rep, 4);
    if (rep[0] != 5)
        die(1, "the sandbox's proxy at 127.0.0.1:%d did not answer as a SOCKS5 server (reply version 0x%02x)",
            proxy_port, rep[0]);
    /* the bound address (not needed), read before a refusal is reported too: closing
     * with unread bytes would reset the connection under the proxy */
    size_t rest = 0;
    switch (rep[3]) {
    case 1: rest = 4 + 2; break;
    case 4: rest = 16 + 2; break;
    case 3:
        read_exact(s, rep + 4, 1);
        rest = (size_t)rep[4] + 2;
        break;
    default:
        if (rep[1] == 0)
            die(1, "the sandbox's proxy at 127.0.0.1:%d answered with an unknown address type 0x%02x", proxy_port,
                rep[3]);
    }
    if (rest)
        read_exact(s, rep + 5, rest);
    if (rep[1] != 0) {
        char buf[400];
        die(1, "%s refused by the sandbox's proxy: %s", target, reply_meaning(rep[1], host, buf, sizeof(buf)));
    }
    return s;
}

/* One direction of the relay: bytes read from `in`, held until `out` takes them. */
struct pipe_dir {
    int in, out;
    unsigned char *buf;
    size_t len, off;
    int eof;  /* `in` ended (or failed) */
    int done; /* everything written and the end passed on */
};

static int is_pipe_or_socket(int fd)
{
    struct stat st;
    return fstat(fd, &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode));
}

static int saved_fl[2] = {-1, -1};

/* Non-blocking stdin/stdout where they are our own pipe or socket ends (as ssh and git
 * give them), so a full pipe never stalls the other direction; a terminal or a file is
 * left as it is (its flags are shared with whoever else holds it). */
static void nonblock_stdio(void)
{
    for (int fd = 0; fd < 2; fd++) {
        if (!is_pipe_or_socket(fd))
            continue;
        int fl = fcntl(fd, F_GETFL);
        if (fl >= 0 && !(fl & O_NONBLOCK) && fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0)
            saved_fl[fd] = fl;
    }
}

static void restore_stdio(void)
{
    for (int fd = 0; fd < 2; fd++)
        if (saved_fl[fd] >= 0)
            fcntl(fd, F_SETFL, saved_fl[fd]);
}

static int relay_error;

/* Read what `d->in` has (when poll said so and the buffer is empty), then write what
 * the buffer holds (at once after a read: the out side is most often ready). */
static void step(struct pipe_dir *d, int sock, int can_read, int can_write, const char *in_name,
                 const char *out_name)
{
    if (can_read && !d->eof && d->len == 0) {
        ssize_t r = read(d->in, d->buf, BUF_SIZE);
        if (r > 0) {
            d->len = (size_t)r;
            d->off = 0;
            can_write = 1;
        } else if (r == 0) {
            d->eof = 1;
        } else if (errno != EAGAIN && errno != EINTR) {
            if (d->in == sock) {
                fprintf(stderr, "%s: %s: %s: %s\n", prog, target, in_name, strerror(errno));
                relay_error = 1;
            }
            d->eof = 1;
        }
    }
    while (can_write && d->len) {
        ssize_t w = write(d->out, d->buf + d->off, d->len);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && errno == EAGAIN)
            break;
        if (w < 0) {
            /* stdout gone (EPIPE): nobody wants the rest; the socket gone: report it */
            if (d->out == sock) {
                fprintf(stderr, "%s: %s: %s: %s\n", prog, target, out_name, strerror(errno));
                relay_error = 1;
            }
            d->len = 0;
            d->eof = 1;
            break;
        }
        d->off += (size_t)w;
        d->len -= (size_t)w;
    }
    if (d->eof && d->len == 0 && !d->done) {
        d->done = 1;
        if (d->out == sock)
            shutdown(sock, SHUT_WR);
        else
            close(d->out);
    }
}

static void relay(int sock)
{
    static unsigned char up_buf[BUF_SIZE], down_buf[BUF_SIZE];
    struct pipe_dir up = {.in = 0, .out = sock, .buf = up_buf};
    struct pipe_dir down = {.in = sock, .out = 1, .buf = down_buf};
    int fl = fcntl(sock, F_GETFL);
    fcntl(sock, F_SETFL, fl | O_NONBLOCK);
    nonblock_stdio();
    while (!(up.done && down.done)) {
        /* [0] stdin, [1] the socket, [2] stdout; an fd with nothing to wait for is left
         * out (-1), else its POLLHUP would spin the loop */
        struct pollfd p[3] = {{.fd = 0}, {.fd = sock}, {.fd = 1}};
        if (!up.eof && up.len == 0)
            p[0].events |= POLLIN;
        if (up.len)
            p[1].events |= POLLOUT;
        if (!down.eof && down.len == 0)
            p[1].events |= POLLIN;
        if (down.len)
            p[2].events |= POLLOUT;
        for (int i = 0; i < 3; i++)
            if (!p[i].events)
                p[i].fd = -1;
        if (poll(p, 3, -1) < 0) {
            if (errno == EINTR)
                continue;
            die(1, "poll: %s", strerror(errno));
        }
        if (!up.done)
            step(&up, sock, p[0].revents != 0, (p[1].revents & (POLLOUT | POLLERR | POLLHUP)) != 0, "stdin", "send");
        if (!down.done)
            step(&down, sock, (p[1].revents & (POLLIN | POLLERR | POLLHUP)) != 0, p[2].revents != 0, "receive",
                 "stdout");
    }
    restore_stdio();
}

int main(int argc, char **argv)
{
    if (argc != 3)
        usage(argc < 3 ? "HOST and PORT are required" : "too many arguments");
    const char *host = argv[1];
    char hostbuf[260];
    size_t hlen = strlen(host);
    if (hlen >= 2 && host[0] == '[' && host[hlen - 1] == ']') { /* [::1] as ssh may write it */
        if (hlen - 2 >= sizeof(hostbuf))
            usage("HOST is longer than 255 bytes");
        memcpy(hostbuf, host + 1, hlen - 2);
        hostbuf[hlen - 2] = 0;
        host = hostbuf;
        hlen -= 2;
    }
    if (hlen == 0)
        usage("HOST is empty");
    if (hlen > 255)
        usage("HOST is longer than 255 bytes");
    for (const char *c = host; *c; c++)
        if ((unsigned char)*c <= ' ' || *c == 0x7f)
            usage("HOST contains a space or a control character");
    long port = parse_port(argv[2]);
    if (port < 0) {
        char what[80];
        snprintf(what, sizeof(what), "bad PORT '%.20s': a number from 1 to 65535", argv[2]);
        usage(what);
    }
    const char *env = getenv("STOCKADE_CONNECT_PORT");
    if (env && *env) {
        long p = parse_port(env);
        if (p < 0)
            die(2, "bad STOCKADE_CONNECT_PORT '%.20s': a number from 1 to 65535 (or unset it)", env);
        proxy_port = (int)p;
    }
    if (strchr(host, ':'))
        snprintf(target, sizeof(target), "[%s]:%ld", host, port);
    else
        snprintf(target, sizeof(target), "%s:%ld", host, port);
    signal(SIGPIPE, SIG_IGN); /* a closed stdout or socket is an error return, not death */
    /* a closed stdin or stdout would make the socket fd 0 or 1, relayed to itself */
    for (int fd = 0; fd < 3; fd++)
        if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) != fd)
            die(1, "cannot open /dev/null for a closed fd %d: %s", fd, strerror(errno));

    int s = socks_connect(host, (int)port);
    relay(s);
    close(s);
    return relay_error;
}
