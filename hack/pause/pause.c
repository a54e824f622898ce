/*
 * The pod sandbox's pause program: it holds the pod's namespaces open and does nothing else.
 *
 * As PID 1 of the sandbox it reaps any child re-parented to it (so no zombie outlives its
 * process) and exits 0 on SIGINT or SIGTERM, which is how the runtime stops a sandbox.
 * Built with `gcc -static -Os` into a FROM-scratch image by hack/image.py.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int signo) {
    (void)signo;
    _exit(0);
}

static void on_child(int signo) {
    (void)signo;
    int saved = errno;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    errno = saved;
}

static int handle(int signo, void (*handler)(int)) {
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_handler = handler;
    action.sa_flags = signo == SIGCHLD ? SA_NOCLDSTOP | SA_RESTART : 0;
    sigemptyset(&action.sa_mask);
    return sigaction(signo, &action, NULL);
}

int main(void) {
    if (handle(SIGINT, on_stop) < 0 || handle(SIGTERM, on_stop) < 0 || handle(SIGCHLD, on_child) < 0) {
        return 1;
    }
    for (;;) {
        pause();
    }
}
