// Command gateway-conformance runs the Gateway API's own conformance suite
// (sigs.k8s.io/gateway-api/conformance) against a cluster whose Gateways are tailnet nodes.
//
// A Gateway's address is a tailnet address, which this machine reaches only through a tailnet
// peer: every connection the suite's HTTP and gRPC clients make is dialled through the HTTP
// CONNECT proxy of a tailscaled "laptop" (--tailnet-proxy), as a tailnet user reaches the Gateway.
// With --on-tailnet, the program runs where tailnet addresses are routed (a network namespace with
// a tailscaled on a TUN device) and every client dials directly, as the suite's TLS tests do,
// which take no dialer. The gRPC client calls in plaintext with prior knowledge (h2c), as the suite's own does. The
// suite's own flags (--gateway-class, --supported-features, --conformance-profiles,
// --report-output, --run-test, --skip-tests, ...) work as documented by the suite; the kubeconfig
// is KUBECONFIG's.
// The suite wants a *testing.T, so this program is a test main with one test.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"net"
	"net/http"
	"regexp"
	"testing"
	"time"

	grpcgo "google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"sigs.k8s.io/gateway-api/conformance"
	"sigs.k8s.io/gateway-api/conformance/utils/grpc"
	"sigs.k8s.io/gateway-api/conformance/utils/roundtripper"
)

var (
	tailnetProxy = flag.String("tailnet-proxy", "",
		"host:port of a tailnet peer's HTTP CONNECT proxy: every connection to a Gateway goes through it")
	onTailnet = flag.Bool("on-tailnet", false,
		"this process's network routes tailnet addresses (a tailscaled on a TUN device): dial directly")
)

func main() {
	testing.Main(regexp.MatchString, []testing.InternalTest{{Name: "TestGatewayAPIConformance", F: run}}, nil, nil)
}

func run(t *testing.T) {
	if (*tailnetProxy == "") == !*onTailnet {
		t.Fatal("give --tailnet-proxy or --on-tailnet (one of them): a Gateway's address is reachable only " +
			"over the tailnet")
	}
	opts := conformance.DefaultOptions(t)
	if *onTailnet {
		conformance.RunConformanceWithOptions(t, opts)
		return
	}
	opts.RoundTripper = &roundtripper.DefaultRoundTripper{
		Debug: opts.Debug, TimeoutConfig: opts.TimeoutConfig, CustomDialContext: dialThroughProxy,
	}
	opts.GRPCClient = tailnetGRPC{}
	conformance.RunConformanceWithOptions(t, opts)
}

// tailnetGRPC is the suite's gRPC client (grpc.Client), dialling through the tailnet proxy. Each
// RPC gets a connection of its own for its address and authority, as the suite's default client
// does when none is given (a given client is reused across tests and Gateways, so it keeps no
// connection); it holds no state, so concurrent RPCs are safe.
type tailnetGRPC struct{}

var _ grpc.Client = tailnetGRPC{}

func (tailnetGRPC) SendRPC(t *testing.T, address string, expected grpc.ExpectedResponse,
	timeout time.Duration) (*grpc.Response, error) {
	t.Helper()
	dial := func(ctx context.Context, address string) (net.Conn, error) {
		return dialThroughProxy(ctx, "tcp", address)
	}
	options := []grpcgo.DialOption{grpcgo.WithTransportCredentials(insecure.NewCredentials()),
		grpcgo.WithContextDialer(dial)}
	if metadata := expected.RequestMetadata; metadata != nil && metadata.Authority != "" {
		options = append(options, grpcgo.WithAuthority(metadata.Authority))
	}
	conn, err := grpcgo.NewClient("passthrough:///"+address, options...)
	if err != nil {
		return &grpc.Response{}, err
	}
	client := &grpc.DefaultClient{Conn: conn}
	defer client.Close()
	return client.SendRPC(t, address, expected, timeout)
}

func (tailnetGRPC) Close() {}

// dialThroughProxy opens a tunnel to address (a Gateway's tailnet IP and a listener's port)
// through the tailnet peer's CONNECT proxy.
func dialThroughProxy(ctx context.Context, _ string, address string) (net.Conn, error) {
	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, "tcp", *tailnetProxy)
	if err != nil {
		return nil, err
	}
	if deadline, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(deadline)
	} else {
		_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	}
	if _, err := fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", address, address); err != nil {
		conn.Close()
		return nil, err
	}
	reader := bufio.NewReader(conn)
	answer, err := http.ReadResponse(reader, &http.Request{Method: http.MethodConnect})
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("CONNECT %s through %s: %w", address, *tailnetProxy, err)
	}
	if answer.StatusCode != http.StatusOK {
		conn.Close()
		return nil, fmt.Errorf("CONNECT %s through %s: %s", address, *tailnetProxy, answer.Status)
	}
	_ = conn.SetDeadline(time.Time{})
	if reader.Buffered() > 0 {
		return &bufferedConn{Conn: conn, reader: reader}, nil
	}
	return conn, nil
}

// bufferedConn is a connection whose first bytes were read along with the proxy's answer.
type bufferedConn struct {
	net.Conn
	reader *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.reader.Read(p) }
