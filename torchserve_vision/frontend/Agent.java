/*
 * The frontend agent of torchserve-vision (`-javaagent:` in the config's vmargs, written by
 * `torchserve-vision server`): when TorchServe's frontend loads the class named in REPLACED, the
 * JVM gets this project's class of the same name instead (ContinuousBatching.java, compiled
 * against TorchServe 0.12.0 and carried in this jar under replacement/). Nothing else changes.
 */
package torchserve_vision.frontend;

import java.io.IOException;
import java.io.InputStream;
import java.lang.instrument.ClassFileTransformer;
import java.lang.instrument.Instrumentation;
import java.security.ProtectionDomain;

public final class Agent {
    static final String REPLACED = "org/pytorch/serve/wlm/ContinuousBatching";
    static final String REPLACEMENT = "/replacement/ContinuousBatching.class.bin";

    private Agent() {}

    public static void premain(String arguments, Instrumentation instrumentation)
            throws IOException {
        final byte[] replacement;
        try (InputStream in = Agent.class.getResourceAsStream(REPLACEMENT)) {
            if (in == null) {
                throw new IOException("the agent jar lacks " + REPLACEMENT);
            }
            replacement = in.readAllBytes();
        }
        instrumentation.addTransformer(
                new ClassFileTransformer() {
                    @Override
                    public byte[] transform(
                            ClassLoader loader,
                            String name,
                            Class<?> redefined,
                            ProtectionDomain domain,
                            byte[] original) {
                        return REPLACED.equals(name) ? replacement : null;
                    }
                });
    }
}
