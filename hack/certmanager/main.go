// Command cert-manager-controller runs cert-manager's registered certificates and issuer
// controllers and its ingress-shim (a Certificate for each spec.tls entry of an annotated Ingress)
// against one kube-apiserver, the way cert-manager's own controller command does, without leader
// election, webhooks, ACME or the gateway shim.
//
// It is a test-only binary: hack/binaries.py builds it in a throwaway module that requires
// github.com/cert-manager/cert-manager at the pinned version.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"strings"
	"sync"
	"syscall"

	controllerpkg "github.com/cert-manager/cert-manager/pkg/controller"
	logf "github.com/cert-manager/cert-manager/pkg/logs"

	// The controllers register themselves with controllerpkg in their init functions.
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificate-shim/ingresses"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificaterequests/approver"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificaterequests/ca"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificaterequests/selfsigned"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/issuing"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/keymanager"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/readiness"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/requestmanager"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/revisionmanager"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/trigger"
	_ "github.com/cert-manager/cert-manager/pkg/controller/clusterissuers"
	_ "github.com/cert-manager/cert-manager/pkg/controller/issuers"
	// The issuer kinds the issuers and clusterissuers controllers can set up.
	_ "github.com/cert-manager/cert-manager/pkg/issuer/ca"
	_ "github.com/cert-manager/cert-manager/pkg/issuer/selfsigned"
)

var defaultControllers = []string{
	"certificaterequests-approver",
	"certificaterequests-issuer-ca",
	"certificaterequests-issuer-selfsigned",
	"certificates-issuing",
	"certificates-key-manager",
	"certificates-readiness",
	"certificates-request-manager",
	"certificates-revision-manager",
	"certificates-trigger",
	"clusterissuers",
	"ingress-shim",
	"issuers",
}

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the apiserver to work against")
	clusterNamespace := flag.String("cluster-resource-namespace", "cert-manager",
		"namespace that holds the Secrets ClusterIssuers refer to")
	namespace := flag.String("namespace", "", "watch only this namespace (default: all)")
	controllers := flag.String("controllers", strings.Join(defaultControllers, ","), "controllers to run")
	flag.Parse()
	if err := run(*kubeconfig, *clusterNamespace, *namespace, strings.Split(*controllers, ",")); err != nil {
		fmt.Fprintf(os.Stderr, "error: %v\n", err)
		os.Exit(1)
	}
}

func run(kubeconfig, clusterNamespace, namespace string, names []string) error {
	logf.InitLogs()
	defer logf.FlushLogs()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx = logf.NewContext(ctx, logf.Log, "cert-manager-controller")

	opts := controllerpkg.ContextOptions{
		Kubeconfig:         kubeconfig,
		KubernetesAPIQPS:   50,
		KubernetesAPIBurst: 100,
		Namespace:          namespace,
		IssuerOptions: controllerpkg.IssuerOptions{
			ClusterResourceNamespace: clusterNamespace,
		},
		CertificateOptions: controllerpkg.CertificateOptions{
			CopiedAnnotationPrefixes: []string{"*", "-kubectl.kubernetes.io/", "-fluxcd.io/", "-argocd.argoproj.io/"},
		},
	}
	factory, err := controllerpkg.NewContextFactory(ctx, opts)
	if err != nil {
		return err
	}
	known := controllerpkg.Known()
	sort.Strings(names)
	var started []controllerpkg.Interface
	for _, name := range names {
		constructor, ok := known[name]
		if !ok {
			return fmt.Errorf("unknown controller %q", name)
		}
		iface, err := constructor(factory)
		if err != nil {
			return fmt.Errorf("constructing %s: %w", name, err)
		}
		started = append(started, iface)
	}

	// The informer factories are shared by every Context the factory builds: start them once all
	// controllers have registered their informers, as cert-manager's controller command does.
	shared, err := factory.Build()
	if err != nil {
		return err
	}
	shared.KubeSharedInformerFactory.Start(ctx.Done())
	shared.SharedInformerFactory.Start(ctx.Done())
	shared.HTTP01ResourceMetadataInformersFactory.Start(ctx.Done())

	var wg sync.WaitGroup
	errs := make(chan error, len(started))
	for i, iface := range started {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := iface.Run(2, ctx); err != nil {
				errs <- fmt.Errorf("%s: %w", names[i], err)
			}
		}()
	}
	fmt.Fprintf(os.Stderr, "cert-manager-controller: running %s\n", strings.Join(names, ","))
	wg.Wait()
	close(errs)
	for err := range errs {
		return err
	}
	return nil
}
